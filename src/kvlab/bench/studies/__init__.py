"""The benchmark studies, one module each (``kvlab bench <study>``), drawing their prompts from
``kvlab.bench.workloads`` and their peers from ``kvlab.bench.peers``."""
