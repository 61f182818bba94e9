"""Keep freed heap memory mapped in long CPU runs, so that each step's large temporaries reuse pages that are
already there instead of faulting in fresh ones.

glibc gives freed memory back to the kernel: a block above the mmap threshold is unmapped when freed, and a
free top of the heap above the trim threshold is trimmed. A training step allocates and frees tens of
megabytes of temporaries (the dense gradients of the selector's [V, rank] codebooks, logits over the draft
vocabulary), so every step faults in fresh zeroed pages, and on a virtual machine page faults are slow
(`docs/benchmarks.md` counts them per step). Raising both thresholds keeps those pages in the process for the
next step: more resident memory (at most ``trim_threshold`` of freed memory), no change to any result.

Process-wide, so only a command that owns its process calls it (``hf-dflash2 train``); anywhere but Linux with
glibc (macOS, Windows, musl) nothing happens.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2, 32 MiB on 64-bit systems.
LARGEST_MMAP_THRESHOLD = 32 << 20


def retain_freed_memory(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """Allocations up to 32 MiB come from the heap, and up to ``trim_threshold`` bytes of freed heap stay
    mapped (the heap grows ``top_pad`` bytes at a time). Returns whether glibc took the settings."""
    if not 0 < trim_threshold < 2**31 or not 0 <= top_pad < 2**31:  # mallopt takes a C int
        raise ValueError(f"trim_threshold must be in (0, 2**31) and top_pad in [0, 2**31), got "
                         f"{trim_threshold} and {top_pad}")
    libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # what this process has loaded
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # musl has mallopt too, and ignores it
        logger.info("allocator: not glibc, freed memory is left to the C library")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    taken = all([mallopt(param, value) == 1 for param, value in (  # each setting tried, whatever the others do
        (M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, trim_threshold), (M_TOP_PAD, top_pad))])
    logger.info("allocator: glibc keeps up to %d MiB of freed memory mapped%s", trim_threshold >> 20,
                "" if taken else " (mallopt refused a setting)")
    return taken


def minor_page_faults() -> int:
    """Minor page faults of this process so far, all its threads (``getrusage``'s ``ru_minflt``; Unix only)."""
    import resource  # not on Windows, where retain_freed_memory must still import and do nothing

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
