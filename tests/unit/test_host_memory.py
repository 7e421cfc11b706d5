"""A rank gives the large tensors torch frees back to the OS (`parallel.runtime.host_memory`): glibc's heaps keep
none of them, whatever was allocated and freed before."""

import ctypes

import pytest
import torch
from trainyard.parallel.runtime.host_memory import return_freed_memory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def test_freed_tensors_of_a_mib_and_more_leave_nothing_in_glibc_s_heaps():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc 2.33+")
    libc.mallinfo2.restype = _Mallinfo2
    assert return_freed_memory()
    first = torch.ones(1 << 20)
    del first  # glibc's own rule: its threshold rises to 4 MiB at this free
    before = libc.mallinfo2()
    large, kept = [], []
    for _ in range(8):  # 4 MiB tensors, each followed by a small one that stays (as a step's tensors interleave)
        large.append(torch.ones(1 << 20))
        kept.append(torch.ones(16 << 10))
    del large
    after = libc.mallinfo2()
    # what the heaps hold free: without the fixed threshold, the 32 MiB just freed, kept between the small ones
    assert after.fordblks - before.fordblks < 4 << 20
    assert after.hblkhd <= before.hblkhd  # and no mapping of the large ones is left
