"""The names the benchmarks' options choose from, importable without torch or the engine: the CLI lists them in
its --help and checks them while the command line is parsed (the benchmarks check them again)."""

from __future__ import annotations

from kvlab.experiment.strategies import BUILTIN_STRATEGIES

COW_WORKLOADS = ("passphrase", "fork", "chat")  # kvlab.bench.studies.cow
BLOCK_WORKLOADS = ("short", "long")  # kvlab.bench.studies.blocksize
# kvlab.bench.studies.cliff: the strategies that change only the cache (not the batch: no injected empty requests,
# no scheduler knobs); strategy_cache refuses the others.
CLIFF_STRATEGIES = tuple(n for n, s in BUILTIN_STRATEGIES.items() if not (s.inject_empty or s.scheduler))
# kvlab.bench.studies.tenants: who shares the prefix cache, from nobody to everyone
TENANT_POLICIES = ("off", "per-tenant", "public-prefixes", "public+promotion", "global")
# kvlab.bench.studies.throughput: what `kvlab bench throughput --workloads` runs (shared-prefix: W<N> for each N of
# --requests; parallel: n samples of each prompt of one W<N>)
THROUGHPUT_WORKLOADS = ("shared-prefix", "no-sharing", "long-context", "chat", "parallel")
