"""`sarazmq capacity --simulate`: the capacity search with every probe simulated."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.sim_options import (
    latency_line,
    load_latency,
    refuse_several_instances,
    sim_config,
    sim_engine_line,
    sim_vocabulary,
)
from sarazmq.config import EngineConfig
from sarazmq.replay.describe import describe
from sarazmq.replay.metrics import summarize
from sarazmq.replay.report import write_run
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.sim.run import sim_run_settings, simulate_workload


class SimProbes:
    """The simulated engine of `capacity --simulate`: its latency model (from the latency
    source options) and, once the workload is known, its KV geometry."""

    def __init__(self, kw: Mapping[str, Any]) -> None:
        if kw.get("connect"):
            raise click.BadParameter("a simulation has no deployment", param_hint="--connect")
        refuse_several_instances(kw, "the capacity search")
        self.latency, self.info = load_latency(kw)
        self.config: EngineConfig | None = None

    def workload_kw(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """The options with a model-free prompt vocabulary (`sim_vocabulary`)."""
        vocab, avoid = sim_vocabulary(kw, self.info)
        return {**kw, "model": "", "vocab_size": vocab, "avoid_ids": avoid}

    def set_workload(self, kw: Mapping[str, Any], requests: Sequence[WorkloadRequest]) -> None:
        """Fixes the engine and its KV geometry (the workload's lengths do not depend on
        the rate)."""
        self.config = sim_config(kw, self.info, requests)
        click.echo(latency_line(self.info))

    def policy_config(self, policy: str) -> EngineConfig:
        """The simulated engine under `policy` (after `set_workload`)."""
        if self.config is None:
            raise RuntimeError("set_workload() first: the KV geometry follows the workload")
        return self.config.with_policy(policy)

    def engine_line(self, kw: Mapping[str, Any], policy: str) -> str:
        del kw  # the engine was fixed by set_workload
        return sim_engine_line(self.policy_config(policy))

    def runner(
        self, spec: WorkloadSpec, kw: Mapping[str, Any], policy: str, out_dir: Path
    ) -> Callable[[float], dict[str, Any]]:
        """The capacity search's run_at_qps: simulates `spec` re-timed at the probed rate,
        writes the probe's run under out_dir/POLICY/qps-RATE/ and returns its summary."""

        config = self.policy_config(policy)

        def run_at_qps(qps: float) -> dict[str, Any]:
            probe_spec = dataclasses.replace(spec, qps=qps)
            requests = build_workload(probe_spec)
            out = simulate_workload(
                requests, config, self.latency, overhead_s=self.info["overhead_s"]
            )
            summary = summarize(out.records, out.iterations)
            write_run(
                out_dir / policy / f"qps-{qps:.4g}",
                summary,
                out.records,
                out.iterations,
                workload=describe(probe_spec, requests, block_size=config.cache.block_size),
                settings=sim_run_settings(config, self.info, out),
                plots=False,
            )
            return summary

        return run_at_qps
