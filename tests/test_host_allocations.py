"""glibc's malloc keeps freed heap for the next step (``autofit.device.steady_host_allocations``)."""
import ctypes
import platform

import pytest
import torch

from autofit.device import steady_host_allocations


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def _mallinfo() -> _MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or platform.libc_ver()[1] < "2.33", reason="glibc's mallopt and mallinfo2")
def test_a_tensor_larger_than_glibcs_own_threshold_comes_from_the_heap_and_its_memory_is_kept():
    assert steady_host_allocations() is True
    assert steady_host_allocations() is True  # once a process: asking again changes nothing
    size = 48 * 2**20  # over the 32 MiB glibc's adaptive threshold reaches at most: mapped afresh without the setting
    mapped_before = _mallinfo().hblkhd
    tensor = torch.empty(size, dtype=torch.uint8)
    assert _mallinfo().hblkhd == mapped_before  # from the heap, not a fresh mapping
    del tensor
    assert _mallinfo().fordblks >= size  # freed, and kept for the next step's allocations
