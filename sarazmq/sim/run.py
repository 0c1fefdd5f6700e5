"""The simulated engine from the engine's own options, and a workload run on it.

A simulation is configured through the same door as a real engine: `EngineOptions` ->
`EngineConfig`. `sim_engine_config` then resolves what a real engine would read off its
model and memory (the KV pool size and the context) from what the simulator derived
(the profile's engine, or the GPU's memory), and `build_sim_scheduler` builds the real
`Scheduler` of that config with `build_scheduler`, on a `SimClock`.
`simulate_workload` is the one call `simulate`, `capacity --simulate` and
`sweep --simulate` make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sarazmq.config import EngineConfig
from sarazmq.options import EngineOptions
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.scheduler import LatencyModel, Scheduler, build_scheduler
from sarazmq.sim.fleet import FleetOutcome
from sarazmq.sim.simulator import SimClock, SimOutcome, simulate


def sim_engine_config(
    options: EngineOptions | EngineConfig, *, num_blocks: int, max_model_len: int
) -> EngineConfig:
    """The resolved config a simulation runs: `options`' config with the KV pool of
    `num_blocks` blocks and a context of `max_model_len` tokens (what a real engine
    resolves from its memory and model). ValueError naming a bad value."""
    config = options.to_config() if isinstance(options, EngineOptions) else options
    for name, value in (("num_blocks", num_blocks), ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    return dataclasses.replace(
        config,
        scheduler=dataclasses.replace(config.scheduler, max_model_len=max_model_len),
        cache=dataclasses.replace(config.cache, num_blocks=num_blocks),
    )


def build_sim_scheduler(config: EngineConfig) -> Scheduler:
    """A fresh real Scheduler of a resolved config (`sim_engine_config`), built as the
    engine builds its own (`build_scheduler`): no EOS ids (requests run with ignore_eos
    to their trace length) and a `SimClock` (a TBT budget reads the clock it is built
    with); as many plans in flight as the config has pipeline stages."""
    return build_scheduler(config, (), SimClock())


def simulate_workload(
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    latency: LatencyModel,
    *,
    overhead_s: float = 0.0,
    progress: bool = False,
) -> SimOutcome:
    """Simulates `requests` on a fresh `build_sim_scheduler(config)` with iteration times
    from `latency` (plus overhead_s each); see `simulator.simulate`. A pipeline latency
    model of pp stages needs a config of pp stages (its plans in flight)."""
    if config.data_parallel_size != 1:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size}: one engine is simulated here; "
            "a fleet of replicas is `sim.fleet.simulate_fleet` (`sarazmq simulate --dp N`)"
        )
    if config.disaggregated:
        raise ValueError(
            "a disaggregated config: prefill and decode instances are simulated by "
            "`sim.disagg.simulate_disaggregated` (`sarazmq simulate --disaggregate P:D`)"
        )
    stages = getattr(latency, "pp", 1)
    if stages != config.pipeline_parallel_size:
        raise ValueError(
            f"the latency model has {stages} pipeline stages but the engine config "
            f"pipeline_parallel_size={config.pipeline_parallel_size}"
        )
    scheduler = build_sim_scheduler(config)
    return simulate(requests, scheduler, latency, overhead_s=overhead_s, progress=progress)


def sim_run_settings(
    config: EngineConfig, latency_info: Mapping[str, Any], out: SimOutcome | FleetOutcome
) -> dict[str, Any]:
    """A simulated run's settings for summary.json: simulated, the engine it stood for (its
    config, as a real run records its own), the latency model's source, and the
    simulation's own wall time."""
    return {
        "simulated": True,
        "latency_model": dict(latency_info),
        "engine": dataclasses.asdict(config),
        "sim_wall_s": out.wall_s,
        "sim_time_s": out.sim_time_s,
        "num_iterations": out.num_iterations,
    } | (
        {"pipeline_parallel_size": out.pipeline.pp}
        if isinstance(out, SimOutcome) and out.pipeline is not None and out.pipeline.pp > 1
        else {}
    )
