"""Which int8 dot-product variants the native library holds (kernels/csrc/int8_dot.c,
int8_panels.c), asked of the library itself.

Torch-free, unlike `int8_dot`: the launcher resolves `gguf_matmul="auto"` with these
(`sarazmq.resolve`) before any process imports torch.
"""

from __future__ import annotations

import ctypes

from .native import load_library


def _built(symbol: str) -> int:
    """What the library's `int symbol(void)` returns; 0 without the library or symbol."""
    lib = load_library()
    if lib is None or not hasattr(lib, symbol):
        return 0
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    return int(fn())


def int8_dot_avx2() -> bool:
    """Whether the AVX2 variant of the kernels was built for this CPU."""
    return bool(_built("int8_dot_avx2_built"))


def int8_dot_vnni() -> bool:
    """Whether the built panels and probe use VPDPBUSD (AVX512-VNNI or AVX-VNNI CPUs)."""
    return bool(_built("int8_dot_vnni_built"))


def int8_panels_vector_bits() -> int:
    """The panel kernel's vector width: 512 (VPDPBUSD on zmm, AVX512-VNNI builds), 256
    (AVX2's VPMADDUBSW or AVX-VNNI's VPDPBUSD), 0 (only the portable loop)."""
    return _built("int8_panels_vector_bits")
