"""Building a worker's model runner from a resolved config (in-process or in a worker process)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.kernels import select_attention_backend_with_reason
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.loader import load_model, resolve_model
from sarazmq.worker.cuda_graphs import DecodeGraphs
from sarazmq.worker.model_runner import ModelRunner
from sarazmq.worker.pipeline import ActivationLink, Placement, StageLinks
from sarazmq.worker.sampler import Sampler

log = logging.getLogger(__name__)


def build_model_runner(
    config: EngineConfig,
    model_config: ModelConfig,
    rank: int = 0,
    tp_group: Any = None,
    *,
    recv_from: ActivationLink | None = None,
    send_to: ActivationLink | None = None,
) -> ModelRunner:
    """Loads this rank's model shard and KV cache (its pipeline stage's layers only); the
    driver (tp rank 0 of the last stage) also gets the sampler.

    rank: the global rank, stage * tp + tp_rank (`sarazmq.worker.pipeline.Placement`);
    tp_group: the stage's tensor-parallel group; recv_from / send_to: the links from the
    previous and to the next pipeline stage (needed exactly where those stages exist).
    """
    placement = Placement(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    stage = (
        StageLinks(placement, recv_from, send_to) if placement.pp_size > 1 else None
    )  # checks the links before the slow load
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches on the current device: it must be this worker's cuda:N
        torch.cuda.set_device(device)
    dtype = getattr(torch, config.dtype)
    attention, attention_reason = select_attention_backend_with_reason(
        config.attention_backend,
        device,
        config.cache.block_size,
        dtype,
        kv_cache_dtype=config.cache.kv_cache_dtype,
    )
    log.info("worker %d: %s", rank, attention_reason)
    model = load_model(
        resolve_model(config.model, config.load_format),
        model_config,
        dtype,
        device,
        attention,
        tp_rank=placement.tp_rank,
        tp_size=config.tensor_parallel_size,
        tp_group=tp_group,
        pp_rank=placement.pp_rank,
        pp_size=placement.pp_size,
    )
    # int8 GGUF matmuls (the config is resolved: "float" or "int8"): every matmul on Q4/Q8
    # blocks by integer dot products, the fused decode step's included (on Q4 panels); the
    # float copies they never read are freed (and so never packed below)
    int8_matmuls = model.set_gguf_matmul(config.gguf_matmul, release_float_copies=True)
    # on CPU: oneDNN-packed matmul weights (faster matmuls; see can_prepack_linear); then
    # the plain copies that no path reads any more (packed for many rows, the GGUF's
    # blocks for decode rows) are freed: the same results in less memory (docs/KERNELS.md)
    model.prepack_linear_weights(drop_unused_plain=True)
    if int8_matmuls:
        log.info("worker %d: %d GGUF matmuls by int8 dot products", rank, int8_matmuls)
    model.fused_decode = not config.enforce_eager
    kv_caches = allocate_kv_cache(
        model_config,
        config.cache.num_blocks,
        config.cache.block_size,
        dtype,
        device,
        config.tensor_parallel_size,
        num_layers=len(model.layer_range),
        kv_cache_dtype=config.cache.kv_cache_dtype,
    )
    sampler = Sampler(model_config.eos_token_ids) if placement.is_driver else None
    graphs = None
    graph_batch = min(config.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    if (
        device.type == "cuda"
        and not config.enforce_eager
        and graph_batch > 0
        and attention.cuda_graph_safe
        and config.tensor_parallel_size == 1
        and placement.pp_size == 1
    ):
        max_blocks = -(-config.scheduler.max_model_len // config.cache.block_size)
        graphs = DecodeGraphs(
            model, kv_caches, config.cache.block_size, graph_batch, max_blocks, device
        )
        seconds = graphs.capture_all()
        log.info(
            "worker %d: %d CUDA graphs captured for decode batches of 1..%d in %.1f s",
            rank,
            len(graphs.sizes),
            graph_batch,
            seconds,
        )
    return ModelRunner(
        model,
        kv_caches,
        config.cache.block_size,
        sampler,
        device,
        stage,
        graphs,
        keep_sampled_tokens=config.async_scheduling,
    )
