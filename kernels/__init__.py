"""Attention and other hot ops; one module per backend, each tested against the torch reference."""

from __future__ import annotations

import torch

from .backend import AttentionBackend
from .cpu_attention import CpuPagedAttention
from .cpu_attention_kernels import cpu_attention_available
from .flash_attn_backend import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    FlashAttnPagedAttention,
    flash_attn_available,
)
from .torch_attention import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "CpuPagedAttention",
    "FlashAttnPagedAttention",
    "TorchPagedAttention",
    "select_attention_backend",
]


def select_attention_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """Returns an attention backend instance.

    name: "auto" -> flash_attn when the device is CUDA, flash-attn imports, block_size is a
    multiple of 256 and dtype (if given) is fp16/bf16; cpu on a CPU where the native
    decode kernel builds; otherwise torch.
    "torch" -> TorchPagedAttention. "cpu" -> CpuPagedAttention (ValueError off CPU or
    when the kernel cannot be built). "flash_attn" -> FlashAttnPagedAttention, raising
    ValueError (not CUDA, bad block size) or ImportError (package missing) when unusable.
    kv_cache_dtype "int8" (`sarazmq.kernels.kv_int8`): never flash_attn (ValueError if
    asked for), whose kernels read fp16/bf16 caches.
    """
    device = torch.device(device)
    if name == "torch":
        return TorchPagedAttention()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"cpu attention backend needs a CPU device, got {device}")
        if not cpu_attention_available():
            raise ValueError(
                "cpu attention backend: the native kernel could not be built (no working C "
                "compiler, or SARAZMQ_NATIVE=0); use --attention-backend torch"
            )
        return CpuPagedAttention()
    if name == "flash_attn":
        if kv_cache_dtype == "int8":
            raise ValueError(
                "the flash_attn attention backend reads fp16/bf16 KV caches, not int8; "
                "use --attention-backend torch"
            )
        if device.type != "cuda":
            raise ValueError(f"flash_attn attention backend needs a CUDA device, got {device}")
        return FlashAttnPagedAttention(block_size)
    if name == "auto":
        if (
            device.type == "cuda"
            and kv_cache_dtype != "int8"
            and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
            and (dtype is None or dtype in (torch.float16, torch.bfloat16))
            and flash_attn_available()
        ):
            return FlashAttnPagedAttention(block_size)
        if device.type == "cpu" and cpu_attention_available():
            return CpuPagedAttention()
        return TorchPagedAttention()
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of ('auto', 'torch', 'cpu', 'flash_attn')"
    )
