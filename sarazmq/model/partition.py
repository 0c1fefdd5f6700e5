"""How a model splits over ranks (tensor-parallel heads, pipeline-stage layers) and what
one KV block costs a rank: torch-free, so that the launcher resolves a deployment
(`sarazmq.resolve`) before any process imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sarazmq.config import ModelConfig
from sarazmq.kernels.kv_layout import ELEMENT_BYTES, kv_row_layout

if TYPE_CHECKING:
    import torch


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
    dtype: torch.dtype | str,
    tp_size: int = 1,
    num_layers: int | None = None,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes one KV block takes on one rank, over its layers (K and V): all of them, or
    `num_layers` (a pipeline stage's); dtype is the model's (a torch dtype or its name),
    kv_cache_dtype the cache's ("auto": the model's; "int8": `sarazmq.kernels.kv_int8`
    rows)."""
    check_tensor_parallel(config, tp_size)
    name = str(dtype).removeprefix("torch.")
    cache_dtype, row = kv_row_layout(kv_cache_dtype, name, config.head_dim)
    if cache_dtype not in ELEMENT_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(ELEMENT_BYTES)}")
    elem = ELEMENT_BYTES[cache_dtype]
    per_layer = 2 * block_size * (config.num_kv_heads // tp_size) * row * elem
    return per_layer * (config.num_layers if num_layers is None else num_layers)
