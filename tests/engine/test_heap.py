"""The engine keeps what a step frees for the next one (kvlab.engine.heap), counted in page faults.

Each case runs in a fresh interpreter: malloc's thresholds are process-wide and the suite's own process has
moved them already. SmolLM2 in bf16 with int8-w8a8 and the compiled kernels is the engine whose steps glibc's
defaults can return to the kernel (and fault in anew) run after run; the mini model's temporaries are too small.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvlab.attention.kernels import paged_attention_kernel
from kvlab.engine.heap import on_glibc
from test_real_models import needs_smollm2

pytestmark = [pytest.mark.skipif(not on_glibc(), reason="glibc's malloc thresholds"), needs_smollm2]

RUNS = """
import ctypes, resource, sys, torch
from kvlab.engine import heap
# glibc's starting thresholds, held there: the process a long-lived server's drift can come back to, made certain
ctypes.CDLL(None).mallopt(heap.M_MMAP_THRESHOLD, 128 << 10)
ctypes.CDLL(None).mallopt(heap.M_TRIM_THRESHOLD, 128 << 10)
torch.set_num_threads(2)
from kvlab import LLM, SamplingParams
llm = LLM("smollm2", dtype="bfloat16", num_blocks=256, max_num_batched_tokens=1024, quantization="int8-w8a8",
          attention_backend="cpp")
prompts = [[1 + (i * 7 + j * 13) % 4000 for j in range(400)] for i in range(4)]
counts = []
for _ in range(4):
    llm.reset_prefix_cache()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(int(heap.retain_freed_memory()), *counts)
"""

# Given back to the kernel, a run's temporaries fault in anew every run (~300,000 pages with glibc held at its
# starting thresholds); kept, a later run faults at most a few hundred (new arenas, Python's own heap: up to ~550
# measured with the rest of the suite beside it).
FRESH = 10_000
KEPT = 3_000


def runs(env: dict[str, str] | None = None) -> tuple[bool, list[int]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | (env or {})
    out = subprocess.run(
        [sys.executable, "-c", RUNS], capture_output=True, text=True, check=True, env=environ, timeout=300
    )
    tuned, *counts = (int(x) for x in out.stdout.split())
    return bool(tuned), counts


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    if paged_attention_kernel() is None:
        pytest.skip("no C++ compiler: the engine runs other ops")


def test_later_runs_reuse_what_the_first_freed() -> None:
    tuned, counts = runs()
    assert tuned
    assert max(counts[1:]) < KEPT, counts


def test_a_threshold_in_the_environment_is_the_operators_choice() -> None:
    """Also the control: the engine leaves the thresholds alone, and the steps fault in anew each run."""
    tuned, counts = runs({"MALLOC_TRIM_THRESHOLD_": str(128 << 10)})
    assert not tuned
    assert min(counts[1:]) > FRESH, counts
