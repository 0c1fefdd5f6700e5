"""The paged KV cache of a Llama-family model: its size per block and its allocation (one
buffer, per layer a K and a V view), for one tensor-parallel rank."""

from __future__ import annotations

import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.memory import zeros_huge_pages


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless tp_size >= 1 splits the heads, KV heads and MLP width evenly."""
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    for field, value in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp_size != 0:
            raise ValueError(f"{field}={value} is not divisible by tp={tp_size}")


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes one KV block takes on one rank, over all layers (K and V)."""
    check_tensor_parallel(config, tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * (config.num_kv_heads // tp_size) * config.head_dim * elem
    return per_layer * config.num_layers


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv_local, D], zeroed.

    All of them are views of one buffer, which on CPU is backed by huge pages where the
    OS allows (see `sarazmq.kernels.memory`): decode touches the cache at scattered slots.
    """
    check_tensor_parallel(config, tp_size)
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    shape = (num_blocks, block_size, config.num_kv_heads // tp_size, config.head_dim)
    per_cache = num_blocks * block_size * shape[2] * shape[3]
    flat = zeros_huge_pages(2 * config.num_layers * per_cache, dtype, device)
    caches = flat.view(config.num_layers, 2, *shape)  # [L, 2, blocks, block_size, Hkv, D]
    return [(caches[i, 0], caches[i, 1]) for i in range(config.num_layers)]
