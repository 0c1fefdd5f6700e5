"""Building the scheduler of a resolved engine config (the one way, for every process)."""

from __future__ import annotations

import time
from collections.abc import Callable

from sarazmq.config import EngineConfig, SchedulerConfig
from sarazmq.scheduler.scheduler import Scheduler


def build_scheduler(
    config: EngineConfig,
    eos_token_ids: tuple[int, ...] = (),
    clock: Callable[[], float] = time.monotonic,
    *,
    num_blocks: int | None = None,
    scheduler_config: SchedulerConfig | None = None,
    instance: int = 0,
) -> Scheduler:
    """The scheduler of a resolved engine config: the one way to build it, for the
    in-process engine, the scheduler process and the simulator alike.

    eos_token_ids: the model's end-of-sequence ids (the simulator has none: its requests
    run to their length); clock: the scheduler's time (the simulator's `SimClock`);
    num_blocks: use only this many of the config's KV blocks (default: all of them);
    scheduler_config: another policy/budget than `config.scheduler` (its max_model_len
    is the config's); instance: which of the config's engine instances it schedules
    (its role in a disaggregated deployment: `EngineConfig.instance_role`).
    """
    sched = scheduler_config or config.scheduler
    return Scheduler(
        sched,
        block_size=config.cache.block_size,
        num_blocks=config.cache.num_blocks if num_blocks is None else num_blocks,
        max_model_len=config.scheduler.max_model_len,
        eos_token_ids=eos_token_ids,
        clock=clock,
        seed=config.seed,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        # one micro-batch per pipeline stage keeps every stage busy
        max_inflight=config.pipeline_parallel_size,
        role=config.instance_role(instance),
        world_size=config.tensor_parallel_size * config.pipeline_parallel_size,
        async_scheduling=config.async_scheduling,
    )
