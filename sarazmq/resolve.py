"""Resolving an `EngineConfig` once, before any process starts: device, context, KV pool size."""

from __future__ import annotations

import dataclasses
import os

import torch

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.model.kv_cache import check_pipeline_parallel, kv_cache_bytes_per_block, stage_layers
from sarazmq.model.loader import load_model_config, resolve_model


def available_memory_bytes(device: str) -> int:
    """Free memory where the KV cache will live."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, ModelConfig]:
    """Fills in device, max_model_len and the KV pool size; checks tensor-parallel fit.

    Returns the resolved config (no field left on "auto"/0) and the model's architecture.
    """
    source = resolve_model(config.model)
    model_config = load_model_config(source)
    tp = config.tensor_parallel_size
    for name, heads in (
        ("num_heads", model_config.num_heads),
        ("num_kv_heads", model_config.num_kv_heads),
    ):
        if heads % tp != 0:
            raise ValueError(
                f"--tp {tp} does not divide the model's {name}={heads}: tensor parallelism "
                f"splits attention heads evenly across ranks"
            )
    pp = config.pipeline_parallel_size
    check_pipeline_parallel(model_config.num_layers, pp)
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")

    sched = config.scheduler
    max_len = sched.max_model_len or model_config.max_position
    if max_len > model_config.max_position:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's context of {model_config.max_position}"
        )
    cache = config.cache
    block_size = cache.block_size
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    num_blocks = cache.num_blocks
    if num_blocks <= 0:
        # the first pipeline stage holds the most layers (see stage_layers)
        stage_layer_count = len(stage_layers(model_config.num_layers, pp, 0))
        per_block = kv_cache_bytes_per_block(
            model_config, block_size, getattr(torch, config.dtype), tp, stage_layer_count
        )
        budget = available_memory_bytes(device) * cache.memory_fraction
        # every rank holds 1/tp of each block of its stage's layers; budget is per device
        # on CUDA, shared by all tp x pp ranks on CPU
        if not device.startswith("cuda"):
            budget /= tp * pp
        by_memory = int(budget // per_block)
        # no point in more than every running request at full context
        by_need = sched.max_num_seqs * -(-max_len // block_size) + 1
        num_blocks = max(1, min(by_memory, by_need))
    resolved = dataclasses.replace(
        config,
        device=device,
        scheduler=dataclasses.replace(sched, max_model_len=max_len),
        cache=dataclasses.replace(cache, num_blocks=num_blocks),
    )
    return resolved, model_config
