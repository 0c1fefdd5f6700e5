"""Large CPU buffers backed by transparent huge pages (best effort).

The paged KV cache is gigabytes, and decode touches it at scattered slots (one write per
new token per layer, one block read per 16 tokens): with 4 KiB pages nearly every access
is a TLB miss, and on a VM each miss walks two page tables, which costs scattered KV
writes several times their time on huge pages (docs/KERNELS.md, "Huge-page KV cache").
Asking the kernel for 2 MiB pages (madvise(MADV_HUGEPAGE), which Linux honours when
/sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always") removes most of
those misses. Elsewhere, or if madvise fails, this is a plain zeroed buffer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14


def _madvise_hugepage(ptr: int, nbytes: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    start = (ptr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (ptr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def _fresh_anonymous(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes] on a private anonymous mapping (zero by the kernel's guarantee, each
    page committed on first touch); None where mmap cannot give one."""
    if not hasattr(mmap, "MAP_PRIVATE") or nbytes < 1:
        return None
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except (OSError, ValueError):
        return None
    # the tensor holds a reference to the mapping: unmapped when the last view goes
    return torch.frombuffer(region, dtype=torch.uint8)


def zeros_huge_pages(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed 1-d tensor of `numel` elements; on a Linux CPU, backed by huge pages where
    the kernel allows (the madvise comes before the first touch).

    On CPU the zeros are a fresh anonymous mapping's, not written here: start-up does not
    touch a pool of gigabytes page by page (seconds, most of a small model's load), and
    the part of the pool a deployment never uses costs no memory. The first write to a
    page pays its fault later, once."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    # over-allocate by one huge page so the aligned middle covers nearly all of it
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * elem
    raw = _fresh_anonymous(nbytes + _HUGE_PAGE)
    fresh = raw is not None
    if raw is None:
        raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[offset : offset + nbytes]
    _madvise_hugepage(buf.data_ptr(), nbytes)
    if not fresh:
        buf.zero_()
    return buf.view(dtype)
