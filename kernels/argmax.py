"""Greedy sampling's row-wise argmax in C (kernels/csrc/argmax.c): the same indices as
`logits.max(dim=-1).indices` (first maximum on ties, a NaN's index where a row holds
one), several times faster on a serving step's [rows, vocab] float32 logits."""

from __future__ import annotations

import ctypes

import torch

from .native import load_library

_fn: list[ctypes._CFuncPtr | None] = []  # [the C function or None], filled on first use


def _get() -> ctypes._CFuncPtr | None:
    if not _fn:
        lib = load_library()
        fn = None
        if lib is not None:
            fn = lib.argmax_rows_f32
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_long,
                ctypes.c_long,
                ctypes.c_long,
                ctypes.c_void_p,
            ]
            fn.restype = None
        _fn.append(fn)
    return _fn[0]


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """Index of each row's largest value of float32 CPU logits [N, V] (unit stride along
    a row, any row stride); None where the kernel does not apply (nothing computed)."""
    if (
        logits.dim() != 2
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.shape[1] < 1
        or (logits.shape[1] > 1 and logits.stride(1) != 1)
    ):
        return None  # decided before the library is loaded (compiled) at all
    fn = _get()
    if fn is None:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        fn(logits.data_ptr(), logits.stride(0), rows, cols, out.data_ptr())
    return out.tolist()
