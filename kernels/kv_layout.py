"""A paged KV cache row's layout, torch-free: the launcher sizes the KV pool with it
(`sarazmq.model.partition.kv_cache_bytes_per_block`) before any process imports torch.

A row is one token's one KV head: D values of the model's dtype, or for the int8 cache
(`sarazmq.kernels.kv_int8`) D int8 values then their float32 scale's 4 bytes.
"""

from __future__ import annotations

from sarazmq.config import KV_CACHE_DTYPES

#: bytes after a row's D int8 values: its float32 scale
INT8_SCALE_BYTES = 4
#: bytes of one element, by dtype name
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """ValueError naming the field unless it is one of KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}"
        )


def kv_row_layout(kv_cache_dtype: str, model_dtype: str, head_dim: int) -> tuple[str, int]:
    """(element dtype name, elements per row) of the cache for a model in `model_dtype`
    ("float32", "bfloat16", ...)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        return "int8", head_dim + INT8_SCALE_BYTES
    return model_dtype, head_dim
