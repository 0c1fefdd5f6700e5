"""Building the simulated engine from flat options and running a workload on it.

`simulate_workload` is the one call `simulate`, `capacity --simulate` and
`sweep --simulate` make; `build_sim_scheduler` is what it builds (a real `Scheduler`,
no model, no KV tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sarazmq.config import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_NUM_SEQS, SchedulerConfig
from sarazmq.perf.model import LatencyModel
from sarazmq.perf.pipeline import PipelineLatency
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.sim.simulator import SimClock, SimOutcome, simulate

#: sched_kw keys read (others are ignored, so a command's whole option dict can be
#: passed), with their defaults: the engine's.
SCHED_DEFAULTS: dict[str, Any] = {
    "scheduler": "sarathi",
    "chunk_size": DEFAULT_CHUNK_SIZE,
    "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
    "watermark": 0.01,
    "enable_prefix_caching": True,
    "tbt_slo": 0.0,
    "latency_profile": "",
}


def scheduler_config(sched_kw: Mapping[str, Any], max_model_len: int) -> SchedulerConfig:
    """The SchedulerConfig of flat options (`SCHED_DEFAULTS` for the missing ones; the
    policy under "scheduler", or "policy"). Raises ValueError naming a bad value."""
    kw = {**SCHED_DEFAULTS, **{k: v for k, v in sched_kw.items() if k in SCHED_DEFAULTS}}
    policy = sched_kw.get("policy", kw["scheduler"])
    return SchedulerConfig(
        policy=policy,
        chunk_size=int(kw["chunk_size"]),
        max_num_seqs=int(kw["max_num_seqs"]),
        watermark=float(kw["watermark"]),
        max_model_len=max_model_len,
        tbt_slo=float(kw["tbt_slo"] or 0.0),
        latency_profile=str(kw["latency_profile"] or ""),
    )


def build_sim_scheduler(
    sched_kw: Mapping[str, Any],
    *,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    seed: int,
    max_inflight: int = 1,
) -> Scheduler:
    """A fresh real Scheduler for a simulation: the policy and limits of `sched_kw`, a
    pool of `num_blocks` blocks of `block_size` tokens, no EOS ids (requests run with
    ignore_eos), prefix caching as sched_kw["enable_prefix_caching"] says (default on),
    and a `SimClock` (a TBT budget reads the clock it is built with). max_inflight: plans
    in flight at once (a pipeline's stages)."""
    for name, value in (
        ("block_size", block_size),
        ("num_blocks", num_blocks),
        ("max_model_len", max_model_len),
        ("max_inflight", max_inflight),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    caching = bool(sched_kw.get("enable_prefix_caching", SCHED_DEFAULTS["enable_prefix_caching"]))
    return Scheduler(
        scheduler_config(sched_kw, max_model_len),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=(),
        clock=SimClock(),
        seed=seed,
        enable_prefix_caching=caching,
        max_inflight=max_inflight,
    )


def simulate_workload(
    requests: Sequence[WorkloadRequest],
    sched_kw: Mapping[str, Any],
    latency: LatencyModel,
    *,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    seed: int,
    overhead_s: float = 0.0,
    progress: bool = False,
) -> SimOutcome:
    """Simulates `requests` on a fresh `build_sim_scheduler(sched_kw, ...)` with
    iteration times from `latency` (plus overhead_s each); see `simulator.simulate`. A
    `PipelineLatency` of pp stages gets a scheduler with pp plans in flight."""
    scheduler = build_sim_scheduler(
        sched_kw,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        seed=seed,
        max_inflight=latency.pp if isinstance(latency, PipelineLatency) else 1,
    )
    return simulate(requests, scheduler, latency, overhead_s=overhead_s, progress=progress)
