"""``kvlab --help`` must not load torch (it took ~3 s when ``import kvlab`` pulled in the engine)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_kvlab_and_its_cli_does_not_import_torch() -> None:
    code = "import sys, kvlab, kvlab.cli; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_still_resolve() -> None:
    import kvlab

    assert kvlab.LLM.__name__ == "LLM" and kvlab.SamplingParams().n == 1
    assert set(kvlab.__all__) >= {"LLM", "Engine", "SamplingParams", "CacheConfig"}
