"""CPU memory: transparent huge pages for torch's large allocations (the weights above all), and
freed activations kept for reuse instead of handed back to the kernel.

A decode step streams every weight once; with 4 KiB pages that is a TLB miss every 4 KiB, and in
a virtual machine each miss walks two page tables. torch's CPU allocator can align allocations
of 2 MiB and more to 2 MiB and `madvise(MADV_HUGEPAGE)` them (`THP_MEM_ALLOC_ENABLE=1`), so the
kernel backs them with huge pages where its THP mode is `madvise` or `always`. Measured on a
2-core Zen 4 KVM guest (THP `madvise`), SmolLM2-135M float32, one thread: the C GEMV over all
linear weights 20-21 ms instead of 22-26 ms, the tied LM head 4.3 ms instead of 5.0 ms.

torch reads the variable once, at its first CPU allocation, so it is a default set first thing
in each child process (`child_process.init_child_process`), like the OpenMP ones; a value the
user set wins. A process that already allocated (an in-process engine) keeps 4 KiB pages.

glibc serves allocations above its mmap threshold (128 KiB, rising to the largest block freed)
with fresh mappings and unmaps them on free, so every step's large activations (a prefill chunk's:
MiBs per layer) come back as fresh pages the kernel must zero: `clear_page_erms` took 2.7% of the
worker's CPU in a bf16 64 x 128 x 64 run on a 2-core AMX Xeon. `keep_freed_memory` (each child, at
start) raises the mmap threshold to glibc's ceiling (32 MiB) and the trim threshold far above it, so
blocks up to 32 MiB come from the heap and stay mapped once freed: the next step reuses the pages
(0.2% there). The cost: the process keeps its peak heap. `TOKENMILL_KEEP_FREED_MEMORY=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

THP_ENV = "THP_MEM_ALLOC_ENABLE"
KEEP_ENV = "TOKENMILL_KEEP_FREED_MEMORY"

# glibc's mallopt parameters, and its largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def set_allocator_defaults() -> None:
    os.environ.setdefault(THP_ENV, "1")
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """Blocks up to `MMAP_THRESHOLD` from the heap, and freed heap memory kept (up to
    `TRIM_THRESHOLD` at its top): True where glibc took both settings."""
    if os.environ.get(KEEP_ENV, "1") in ("0", "false", "no") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
