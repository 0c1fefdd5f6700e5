"""The engines of `sarazmq sweep` built from its options: deployments or the simulator,
with the cost model and machine limits MFU/MBU are measured against."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click

from sarazmq.cli.sim_options import GPU_ELEM_BYTES
from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.sweep.runner import Backend, SweepSettings


def machine_probe(enabled: bool, dtype: str) -> Callable[[], tuple[float, float] | None]:
    """The sweep's probe: (GEMM FLOP/s in `dtype`, read bandwidth) now, printed; None
    when disabled."""

    def probe() -> tuple[float, float] | None:
        if not enabled:
            return None
        import torch

        from sarazmq.perf.machine import probe_machine

        m = probe_machine(getattr(torch, dtype))
        click.echo(f"machine: {m}")
        return (m.gemm_flops, m.bandwidth_bytes_s)

    return probe


def run_dtype(kw: dict[str, Any]) -> str:
    """The dtype the engine options `kw` run in ("auto" resolved for their device)."""
    from sarazmq.resolve import resolve_device, resolve_dtype

    return resolve_dtype(kw["dtype"], resolve_device(kw.get("device", "auto")))


def dtype_bytes(dtype: str) -> int:
    """Bytes per weight/KV element of a run dtype (float32: 4, bf16/fp16: 2)."""
    return 4 if dtype == "float32" else 2


def real_backend_of(
    kw: dict[str, Any], base: Any, model_config: Any
) -> tuple[Backend, SweepSettings]:
    """Deployments of `base` per (policy, chunk); MFU/MBU of --model against the probe."""
    from sarazmq.perf.cost import ModelCost
    from sarazmq.sweep.backends import ReplayOptions, real_backend

    tp = kw["tensor_parallel_size"]
    cost = ModelCost.from_model_config(model_config, dtype_bytes(run_dtype(kw)), tp)
    backend = real_backend(
        base,
        DeploymentConfig(num_detokenizers=kw["num_detokenizers"]),
        ReplayOptions(kw["progress"], kw["concurrency"], kw["request_timeout"]),
        on_ready=click.echo,
    )
    keep = True if kw["keep_runs"] is None else kw["keep_runs"]
    settings = SweepSettings(
        slo_ttft=kw["slo_ttft"], slo_tbt=kw["slo_tbt"], cost=cost, keep_runs=keep, mode="real"
    )
    return backend, settings


def sim_backend_of(
    kw: dict[str, Any],
    latency: Any,
    info: dict[str, Any],
    config: EngineConfig,
    model_config: Any,
) -> tuple[Backend, SweepSettings]:
    """The simulator of `config` (the resolved `sim_options.sim_config`); MFU/MBU against the GPU (--gpu, bf16 costs of --arch) or the
    profile's machine probe (costs of --model in --dtype)."""
    from sarazmq.perf.cost import ModelCost
    from sarazmq.sweep.backends import SimSetup, sim_backend

    tp = kw["tensor_parallel_size"]
    if kw["gpu"]:
        from sarazmq.perf.architectures import get_gpu

        gpu = get_gpu(kw["gpu"])
        cost = ModelCost.from_architecture(kw["arch"], GPU_ELEM_BYTES, tp)
        peak, bandwidth = gpu.peak_flops, gpu.bandwidth
    else:
        cost = ModelCost.from_model_config(model_config, dtype_bytes(run_dtype(kw)), tp)
        machine = info.get("machine") if isinstance(info.get("machine"), dict) else {}
        peak, bandwidth = machine.get("gemm_flops"), machine.get("bandwidth_bytes_s")
    setup = SimSetup(
        config=config,
        latency=latency,
        overhead_s=info.get("overhead_s", 0.0),
        latency_info=info,
    )
    keep = False if kw["keep_runs"] is None else kw["keep_runs"]
    settings = SweepSettings(
        slo_ttft=kw["slo_ttft"],
        slo_tbt=kw["slo_tbt"],
        cost=cost,
        peak_flops=peak,
        bandwidth=bandwidth,
        keep_runs=keep,
        mode="simulate",
        extra={
            "latency_model": info,
            "engine": dataclasses.asdict(config),
            # the pool and context the simulator derived (also inside "engine")
            "geometry": {
                "block_size": config.cache.block_size,
                "num_blocks": config.cache.num_blocks,
                "max_model_len": config.scheduler.max_model_len,
            },
        },
    )
    return sim_backend(setup), settings
