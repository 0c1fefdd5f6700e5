"""The engines a sweep runs points on: real deployments, or the simulator.

`real_backend`: one `Deployment` per (policy, chunk), started by replay's `target` and
reused for all its points; workloads are sent by replay's driver (`replay_detailed`).
Before each point the engine is warmed up (its first point only) and its prefix cache
emptied. `sim_backend`: the discrete-event simulator (`sarazmq.sim`) with the real
scheduler and iteration times from a latency model; nothing is started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sarazmq.client import AsyncClient
from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.replay.driver import (
    WARMUP_OUTPUT_TOKENS,
    WARMUP_PROMPT_TOKENS,
    clock_check,
    replay_detailed,
    target,
)
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sampling_params import SamplingParams
from sarazmq.sweep.runner import Backend, Engine, EngineRun


@dataclass(frozen=True)
class ReplayOptions:
    """How the real backend's driver sends a workload (replay's flags)."""

    progress: bool = False
    concurrency_limit: int | None = None
    timeout: float | None = None


class _DeploymentEngine:
    def __init__(
        self,
        endpoint: str,
        engine: Mapping[str, Any],
        options: ReplayOptions,
        warn: Callable[[str], None],
        reset_cache: bool,
    ) -> None:
        self.reset_cache = reset_cache
        self.endpoint = endpoint
        self.engine = dict(engine)
        self.options = options
        self.warn = warn

    async def _prepare(self, warmup: bool) -> None:
        async with AsyncClient(self.endpoint) as client:
            if warmup:
                params = SamplingParams(
                    temperature=0.0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True
                )
                await client.generate([100] * WARMUP_PROMPT_TOKENS, params)
            if self.reset_cache:
                await client.reset_prefix_cache()

    def run(
        self, requests: Sequence[WorkloadRequest], description: str, *, warmup: bool
    ) -> EngineRun:
        # Points with the same seed share prompts (a share's short requests, every load):
        # the prefix cache must not carry one point's prompts into the next.
        asyncio.run(self._prepare(warmup))
        out = asyncio.run(
            replay_detailed(
                self.endpoint,
                requests,
                progress=self.options.progress,
                concurrency_limit=self.options.concurrency_limit,
                timeout=self.options.timeout,
                warmup=False,
                description=description,
            )
        )
        warning = clock_check(out.records)
        if warning:
            self.warn(f"warning: {warning}")
        settings = {
            **out.settings,
            "engine": self.engine,
            "wall_s": out.wall_s,
            "max_send_lag_s": out.max_send_lag_s,
        }
        return EngineRun(out.records, out.iterations, settings)


def real_backend(
    base: EngineConfig,
    deployment: DeploymentConfig,
    options: ReplayOptions = ReplayOptions(),
    *,
    on_ready: Callable[[str], None] = print,
) -> Backend:
    """Opens a fresh deployment of `base` with the point's policy and chunk size."""

    @contextlib.contextmanager
    def open_engine(policy: str, chunk: int) -> Iterator[Engine]:
        config = base.with_policy(policy, chunk)
        with target(None, config, deployment) as (endpoint, engine):
            on_ready(f"deployment {policy} chunk {chunk} ready")
            yield _DeploymentEngine(
                endpoint, engine, options, on_ready, base.cache.enable_prefix_caching
            )

    return open_engine


@dataclass(frozen=True)
class SimSetup:
    """The simulated engine: its resolved config (`sim.run.sim_engine_config`; each point
    runs it under the point's policy and chunk), the latency model and where it came
    from, and a fixed per-iteration overhead."""

    config: EngineConfig
    latency: Any  # a sarazmq.scheduler.LatencyModel
    overhead_s: float = 0.0
    latency_info: Mapping[str, Any] = field(default_factory=dict)


class _SimEngine:
    def __init__(self, setup: SimSetup, policy: str, chunk: int) -> None:
        self.setup = setup
        self.config = setup.config.with_policy(policy, chunk)

    def run(
        self, requests: Sequence[WorkloadRequest], description: str, *, warmup: bool
    ) -> EngineRun:
        del description, warmup  # nothing to warm in simulated time
        from sarazmq.sim.run import sim_run_settings, simulate_workload

        s = self.setup
        # a fresh scheduler per workload: points share no KV or prefix-cache state
        out = simulate_workload(requests, self.config, s.latency, overhead_s=s.overhead_s)
        return EngineRun(
            out.records, out.iterations, sim_run_settings(self.config, s.latency_info, out)
        )


def sim_backend(setup: SimSetup) -> Backend:
    """Opens a simulated engine (nothing to start or stop)."""

    @contextlib.contextmanager
    def open_engine(policy: str, chunk: int) -> Iterator[Engine]:
        yield _SimEngine(setup, policy, chunk)

    return open_engine
