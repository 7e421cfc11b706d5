"""A rank's host memory returned to the OS when torch frees it: glibc's mmap threshold fixed.

glibc's malloc serves a block of at least its mmap threshold with its own mmap, unmapped on free, and smaller ones
from its heaps, which keep what is freed for reuse. The threshold starts at 128 KiB and, each time a mapped block
is freed, rises to that block's size (up to 32 MiB on 64-bit): after a step's first large frees, a rank's
gathered blocks (9-25 MB matrices each at d_model 1536), their whole gradients and the loss's logits come from
the heaps, and what the heaps keep after they are freed, fragmented between what is still live, stays in the
process's resident memory. Measured on the `scale` bench's 199M Llama at dp=4, zero=3 (bench/scale.py): glibc
held 0.2-0.4 GiB free in its heaps through the backward, about a fifth of the rank's peak above its baseline, so
the rank's high-water mark read from the OS (what a node's memory monitor kills on) stood that far above the
bytes torch held. Setting the threshold once (`mallopt(M_MMAP_THRESHOLD)`) also turns its rise off: every
tensor of a MiB or more is mapped and unmapped on its own, and the resident memory follows what torch holds.
The price is a fresh mapping (its pages faulted in) for each such tensor instead of reused heap memory: on the dp
bench's 3M-parameter GPT (bench/dp2.yaml, one process, forward, backward and AdamW) 3,500-6,200 minor page faults a
step against glibc's own 1,300-1,500, 1-4% of the step's CPU. So only a rank the memory plan puts at
RETURN_FROM_BYTES of host memory or more fixes the threshold (`returns_freed_memory`): there the heaps' slack is what
a memory monitor kills on; on a smaller rank it is tens of MB, and the page faults are a cost for nothing.

glibc only (Linux); elsewhere (musl, macOS) nothing is done. `resident_bytes` reads what the OS counts of this
process (VmRSS, VmHWM): the worker's figures and the benches' read it.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc's malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks from 1 MiB up are mapped on their own: every parameter, gradient or activation that counts in a plan."""


RETURN_FROM_BYTES = 1 << 30
"""A rank whose predicted host memory is at least this fixes glibc's threshold (`returns_freed_memory`)."""


def returns_freed_memory(predicted_host_bytes: int) -> bool:
    """Whether a rank the memory plan puts at `predicted_host_bytes` of host memory should fix the threshold."""
    return predicted_host_bytes >= RETURN_FROM_BYTES


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (see the module docstring); False where it is not glibc."""
    libc = ctypes.CDLL(None)  # the process's own symbols: libc's, without find_library's ldconfig subprocess
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):  # the latter: glibc only
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def resident_bytes(field: str) -> int | None:
    """A resident-memory field of /proc/self/status (VmRSS now, VmHWM the high-water mark) in bytes; None where
    there is no /proc (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    return None
