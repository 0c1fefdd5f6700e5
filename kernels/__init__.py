"""Attention and other hot ops; one module per backend, each tested against the torch reference.

The package's names load on first use (PEP 562), not when a submodule is imported: the
torch-free ones (`native`, `int8_isa`) then serve processes that never import torch, such
as the launcher resolving a config (`sarazmq.resolve`).
"""

from __future__ import annotations

import importlib
from typing import Any

#: exported name -> the submodule that defines it
_EXPORTS = {
    "AttentionBackend": "backend",
    "CpuPagedAttention": "cpu_attention",
    "FlashAttnPagedAttention": "flash_attn_backend",
    "TorchPagedAttention": "torch_attention",
    "TritonPagedAttention": "triton_backend",
    "choose_attention_backend": "selection",
    "select_attention_backend": "selection",
    "select_attention_backend_with_reason": "selection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
