"""Building kvlab's small C++ ops on first use (the opt-in ``cpp`` kernels), with one way to fail.

Each op set is a ``torch.utils.cpp_extension.load_inline`` module, compiled once and cached on disk by torch
(``TORCH_EXTENSIONS_DIR``). The build targets this CPU (``-march=native``; the sources pick ATen's AVX512 or
AVX2 vectors from what the compiler then targets), so a module's name carries a digest of the CPU's flags: a
cache directory shared with another CPU never loads code that machine cannot run. Where no compiler, ninja or
headers exist, ``build`` logs one line and returns None, and the caller serves with its reference path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# Picks at::vec's instruction set from what the compiler targets: AVX512 or AVX2 where this CPU has them, the
# portable fallback elsewhere, and gives every op set the same fp32 vector loads and stores of fp32 or bf16
# storage. Sources start with it, before any ATen header.
VEC_PRELUDE = r"""
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

using Vec = at::vec::Vectorized<float>;
static constexpr int64_t W = Vec::size();

// W values at p widened to fp32, and W fp32 values stored rounded to the storage type (round to nearest even,
// as c10's conversion).
static inline Vec load_f(const float* p) { return Vec::loadu(p); }
static inline Vec load_f(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
static inline void store_f(float* p, const Vec& v) { v.store(p); }
static inline void store_f(c10::BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
#else
  float tmp[W];
  v.store(tmp);
  for (int64_t i = 0; i < W; ++i) p[i] = static_cast<c10::BFloat16>(tmp[i]);
#endif
}
"""


def call_labelled(label: str, op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``op(*args)``, under a ``torch.profiler`` label while a profiler runs: a pybind op is invisible to it
    without one (``bench step --profile``), and the label costs microseconds a call, so it is only put on then."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            return op(*args)
    return op(*args)


def cpu_digest() -> str:
    """A short digest of what ``-march=native`` compiles for: the architecture and the CPU's feature flags."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))),
            "",
        )
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def build(name: str, source: str, functions: list[str], what: str) -> ModuleType | None:
    """The compiled module ``name`` (versioned by the caller, suffixed here with the CPU digest), or None after
    one warning naming ``what`` falls back to its reference. A build (not a load from the cache) says so first:
    it takes about a minute, once per CPU, and a run that sits silent that long looks hung."""
    try:
        from torch.utils import cpp_extension

        full_name = f"{name}_{cpu_digest()}"
        where = _build_directory(cpp_extension.get_default_build_root(), full_name)
        t0 = time.perf_counter()
        with builder_lock(where):
            fresh = not (where / f"{full_name}.so").exists()
            if fresh:
                log.warning("building %s for this CPU: once, about a minute; cached in %s", what, where)
            with _spinner(f"building {what} (once for this CPU)") if fresh else contextlib.nullcontext():
                module = cpp_extension.load_inline(
                    name=full_name,
                    cpp_sources=[source],
                    functions=functions,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
    except Exception as exc:  # no compiler, no ninja, no headers: the reference path serves
        log.warning("%s unavailable (%s: %s); using the reference", what, type(exc).__name__, exc)
        return None
    log.info("%s ready in %.1f s (compiled, or loaded from torch's extension cache)", what, time.perf_counter() - t0)
    return module


@contextlib.contextmanager
def builder_lock(where: Path) -> Iterator[None]:
    """Hold kvlab's own lock on ``where`` while torch builds or loads there.

    torch's lock is a plain file (``where/lock``) that a process killed while holding it leaves behind, and every
    later build or load then waits on it for ever (a fuzz worker killed on purpose hung whole test runs, even
    mid-load). Every kvlab process takes this ``flock`` first, and the kernel releases it when its holder dies: so
    whoever holds it knows that a ``lock`` file it finds is a dead holder's, and removes it (one log line)."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "kvlab-builder.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            _clear_dead_lock(where)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_dead_lock(where: Path) -> bool:
    """Remove torch's ``where/lock``: called only under ``builder_lock``, where its holder must be dead."""
    lock = where / "lock"
    if not lock.exists():
        return False
    log.warning("removing a build lock its builder left behind when it died: %s", lock)
    with contextlib.suppress(OSError):
        lock.unlink()
    return True


def _build_directory(default_root: str, full_name: str) -> Path:
    """Where torch's cpp_extension caches ``full_name`` (its rule, for the CPU build: TORCH_EXTENSIONS_DIR, else
    the default root's pyXY_cpu folder). Only the build notice depends on it: a wrong guess says "building"
    before a load."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        root = os.path.join(default_root, f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_cpu")
    return Path(root) / full_name


@contextlib.contextmanager
def _spinner(text: str) -> Iterator[None]:
    """A spinner on a terminal's stderr while a build runs (elsewhere the warning line alone says it)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield
