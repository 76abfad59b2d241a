"""The process's two heaps set for serving: glibc's malloc keeps what a step frees, and Python's collector leaves
alone what exists when an engine is built.

**malloc.** A forward pass allocates its activations fresh (PyTorch's CPU allocator takes them from malloc and gives
them back at once). glibc serves a block above its mmap threshold (128 KiB at first, then raised to the largest
block freed, up to 32 MiB) with a fresh mapping, and gives the top of its heap back to the kernel once more than its
trim threshold (twice the mmap threshold) lies free there. A prefill step's temporaries of several MiB each thus
come back as fresh pages step after step, and the kernel faults and zeroes every 4 KiB of them: the same work
done again each step, measured in docs/performance.md ("The allocator"). vLLM's CPU backend avoids it by
preloading tcmalloc; the engine instead fixes glibc's two thresholds once per process (which also stops their
drift: a run's speed no longer depends on what the process freed before it). The cost is resident memory: what
the largest step freed stays with the process until it exits.

Left alone: a process whose environment sets either threshold itself (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``: the operator chose), or a C library other than glibc (another ``malloc`` preloaded
answers ``mallopt`` as it likes).

**The collector.** Python's cyclic collector walks every object it tracks in a full collection, and torch, the
tokenizer and a loaded model are most of them: one full collection costs as long as several decode steps, and one
falls into a run whenever enough new objects have piled up, on whichever step that is (measured:
docs/performance.md, "The collector"). vLLM freezes the collector's heap once its model is warmed up; the first
engine a process builds does the same (``freeze_live_objects``), so a collection walks only what was made since. A
frozen object is still freed by its reference count; one that died in a reference cycle would never be, which is
why an engine, its model and an ``LLM`` hold no cycle (tests/engine/test_collector.py frees them with the collector
off).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a block below it comes from the heap.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top above this goes back to the kernel; below it the next step reuses it.
TRIM_THRESHOLD = 1 << 30

ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def on_glibc() -> bool:
    """Is this process's C library glibc (whose thresholds ``retain_freed_memory`` sets)?"""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@functools.cache
def retain_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process (once); whether they were set. False (and nothing
    changed) outside glibc, or where the environment sets either threshold."""
    if not on_glibc():
        return False
    if chosen := [name for name in ENVIRONMENT if name in os.environ]:
        log.info("malloc thresholds left as the environment sets them (%s)", ", ".join(chosen))
        return False
    libc = ctypes.CDLL(None)
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if done:
        log.info(
            "glibc malloc: blocks under %d MiB from the heap, kept up to %d MiB free (a step's temporaries reused)",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    else:
        log.warning("glibc's mallopt refused the thresholds: each step's temporaries come back as fresh pages")
    return done


@functools.cache
def freeze_live_objects() -> int:
    """Once per process (the first engine's build): collects what is garbage, then moves every object alive into
    the collector's permanent generation (``gc.freeze``), where no later collection walks it. Returns how many
    objects it froze. Later engines leave the heap as it is: their own objects are few, and the full collection
    before a freeze would cost each of them (a test process builds hundreds) a walk of the whole heap."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("collector: the %d objects alive at the first engine's build frozen", frozen)
    return frozen
