"""The paged KV cache of a Llama-family model: its size per block and its allocation (one
buffer, per layer a K and a V view), for one tensor-parallel rank of one pipeline stage
(and how the layers split into stages)."""

from __future__ import annotations

import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.kv_int8 import kv_cache_layout
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


def stage_layers(num_layers: int, pp_size: int = 1, pp_rank: int = 0) -> range:
    """The layers pipeline stage `pp_rank` of `pp_size` holds: a contiguous, even split
    in which the earlier stages take one layer more when pp_size does not divide
    num_layers (10 layers over 4 stages: 3, 3, 2, 2). ValueError for a bad split."""
    check_pipeline_parallel(num_layers, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, {pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_pipeline_parallel(num_layers: int, pp_size: int) -> None:
    """ValueError unless 1 <= pp_size <= num_layers (every stage holds a layer)."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size={pp_size} must be >= 1")
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's num_layers={num_layers}: "
            "every pipeline stage needs at least one layer"
        )


def kv_cache_bytes_per_block(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    tp_size: int = 1,
    num_layers: int | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one KV block takes on one rank, over its layers (K and V): all of them, or
    `num_layers` (a pipeline stage's); dtype is the model's, kv_cache_dtype the cache's
    ("auto": the model's; "int8": `sarazmq.kernels.kv_int8` rows)."""
    check_tensor_parallel(config, tp_size)
    cache_dtype, row = kv_cache_layout(kv_cache_dtype, dtype, config.head_dim)
    elem = torch.empty((), dtype=cache_dtype).element_size()
    per_layer = 2 * block_size * (config.num_kv_heads // tp_size) * row * elem
    return per_layer * (config.num_layers if num_layers is None else num_layers)


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
