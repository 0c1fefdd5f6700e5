"""The paged KV cache of a Llama-family model: its size per block and its allocation (one
buffer, per layer a K and a V view), for one tensor-parallel rank of one pipeline stage
(and how the layers split into stages)."""

from __future__ import annotations

import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.kv_int8 import kv_cache_layout
from sarazmq.kernels.memory import zeros_huge_pages

# how layers and heads split over ranks, and a block's bytes (torch-free, for the
# launcher), here too for the callers that allocate caches
from .partition import (  # noqa: F401
    check_pipeline_parallel,
    check_tensor_parallel,
    kv_cache_bytes_per_block,
    stage_layers,
)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
    num_layers: int | None = None,
    kv_cache_dtype: str = "auto",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv_local, D], zeroed;
    for all the model's layers, or `num_layers` (a pipeline stage's, see `stage_layers`).
    kv_cache_dtype "int8": int8 rows [..., D + 4] instead (`sarazmq.kernels.kv_int8`).

    All of them are views of one buffer, which on CPU is backed by huge pages where the
    OS allows (see `sarazmq.kernels.memory`): decode touches the cache at scattered slots.
    """
    check_tensor_parallel(config, tp_size)
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    cache_dtype, row = kv_cache_layout(kv_cache_dtype, dtype, config.head_dim)
    shape = (num_blocks, block_size, config.num_kv_heads // tp_size, row)
    per_cache = num_blocks * block_size * shape[2] * shape[3]
    layers = config.num_layers if num_layers is None else num_layers
    if not 1 <= layers <= config.num_layers:
        raise ValueError(f"num_layers={layers} must be in [1, {config.num_layers}]")
    flat = zeros_huge_pages(2 * layers * per_cache, cache_dtype, device)
    caches = flat.view(layers, 2, *shape)  # [L, 2, blocks, block_size, Hkv, D]
    return [(caches[i, 0], caches[i, 1]) for i in range(layers)]
