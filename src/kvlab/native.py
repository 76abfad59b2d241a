"""Building kvlab's small C++ ops on first use (the opt-in ``cpp`` kernels), with one way to fail.

Each op set is a C++ file of ``kvlab/csrc`` (``source`` reads it, with the shared ``vec_prelude.h`` put in place
of its ``#include``), compiled by ``torch.utils.cpp_extension.load_inline`` once and cached on disk by torch
(``TORCH_EXTENSIONS_DIR``). The module's name is the op set's and a key (``cache_key``): a digest of the source,
the compiler flags, torch's version, the Python ABI and this CPU's flags (the build targets it:
``-march=native``). So a cache directory shared with another venv, another torch or another CPU never hands
over a build that is not this one's, and a source change needs no hand-bumped name; and a module whose file is
not in the cache is built, which ``build`` says in one line before it starts. Where no compiler, ninja or
headers exist, ``build`` logs one line and returns None, and the caller serves with its reference path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
PRELUDE_INCLUDE = '#include "vec_prelude.h"'
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

Result = TypeVar("Result")


def profiling() -> bool:
    """Is a ``torch.profiler`` recording (``bench step --profile``)?"""
    return bool(torch.autograd._profiler_enabled())


def call_labelled(label: str, op: Callable[..., Result], *args: object) -> Result:
    """``op(*args)``, under a ``torch.profiler`` label while a profiler runs: a pybind op is invisible to it
    without one (``bench step --profile``), and the label costs microseconds a call, so it is only put on then."""
    if profiling():
        with torch.profiler.record_function(label):
            return op(*args)
    return op(*args)


def source(name: str) -> str:
    """The C++ source of ``csrc/name`` as the compiler gets it: ``vec_prelude.h`` in place of its ``#include``
    (``load_inline`` compiles a copy of the text elsewhere, where no include path would find the header)."""
    text = (CSRC / name).read_text(encoding="utf-8")
    if PRELUDE_INCLUDE not in text:
        return text
    prelude = (CSRC / "vec_prelude.h").read_text(encoding="utf-8").replace("#pragma once\n", "")
    return text.replace(PRELUDE_INCLUDE, prelude, 1)


def cache_key(source_text: str) -> str:
    """What a build depends on, digested: the source, the flags, torch, the Python ABI and the CPU."""
    abi = f"{sys.implementation.cache_tag}{sys.abiflags} {platform.machine()}"
    parts = [source_text, " ".join(CFLAGS + LDFLAGS), torch.__version__, abi, cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


@functools.cache  # read once a process: every op set's key asks
def cpu_flags() -> str:
    """What ``-march=native`` compiles for: this CPU's feature flags (empty where /proc/cpuinfo says none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def build(name: str, source_text: str, functions: list[str], what: str) -> ModuleType | None:
    """The compiled module ``name`` (suffixed here with ``cache_key``), or None after one warning naming ``what``
    falls back to its reference. A build (its module not in the cache) says so first: it takes about a minute,
    once per source, torch and CPU, and a run that sits silent that long looks hung."""
    try:
        from torch.utils import cpp_extension

        full_name = f"{name}_{cache_key(source_text)}"
        where = _build_directory(cpp_extension.get_default_build_root(), full_name)
        t0 = time.perf_counter()
        with builder_lock(where):
            fresh = not (where / f"{full_name}.so").exists()
            if fresh:
                log.warning("building %s for this CPU and torch: once, about a minute; cached in %s", what, where)
            with _spinner(f"building {what} (once for this CPU)") if fresh else contextlib.nullcontext():
                module = cpp_extension.load_inline(
                    name=full_name,
                    cpp_sources=[source_text],
                    functions=functions,
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),
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
