"""Attention and other hot ops; one module per backend, each tested against the torch reference."""

from __future__ import annotations

import torch

from .flash_attn_backend import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    FlashAttnPagedAttention,
    flash_attn_available,
)
from .torch_attention import TorchPagedAttention

AttentionBackend = TorchPagedAttention | FlashAttnPagedAttention

__all__ = [
    "AttentionBackend",
    "FlashAttnPagedAttention",
    "TorchPagedAttention",
    "select_attention_backend",
]


def select_attention_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Returns an attention backend instance.

    name: "auto" -> flash_attn when the device is CUDA, flash-attn imports, block_size is a
    multiple of 256 and dtype (if given) is fp16/bf16; otherwise torch.
    "torch" -> TorchPagedAttention. "flash_attn" -> FlashAttnPagedAttention, raising
    ValueError (not CUDA, bad block size) or ImportError (package missing) when unusable.
    """
    device = torch.device(device)
    if name == "torch":
        return TorchPagedAttention()
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError(f"flash_attn attention backend needs a CUDA device, got {device}")
        return FlashAttnPagedAttention(block_size)
    if name == "auto":
        if (
            device.type == "cuda"
            and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
            and (dtype is None or dtype in (torch.float16, torch.bfloat16))
            and flash_attn_available()
        ):
            return FlashAttnPagedAttention(block_size)
        return TorchPagedAttention()
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of ('auto', 'torch', 'flash_attn')"
    )
