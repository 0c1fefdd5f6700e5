"""A fleet of data-parallel replicas in simulated time, behind one router.

N real schedulers (each built by `build_scheduler` from the same config, each on its own
`SimClock`) and the deployment's own `Router` (`sarazmq.router`): every request is routed
when it arrives, with each replica's load as its scheduler reports it after each of its
iterations (`Scheduler.load`) plus what was routed to it since, as in a deployment. The
event loop takes, in time order, the next arrival or the next end of a replica's
iteration:

    arrival at t:     route it; the replica admits it (its clock at t); an idle replica
                      plans its next iteration at t
    iteration ends:   the replica processes its result at its end time, reports its load,
                      and plans its next iteration there

Iteration times come from one `LatencyModel` (every replica the same hardware), plus
overhead_s each. Without pipeline parallelism (pp = 1). The outcome holds the requests'
records (so `summarize` applies), per-replica counters (iterations, busy time, prefix-cache
hits) and the router's; iteration samples only when asked for (a fleet of 256 replicas
runs millions of iterations).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from sarazmq.config import EngineConfig
from sarazmq.protocol.worker import StepResult
from sarazmq.replay.metrics import IterationSample, RequestRecord, summarize
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.router import build_router, prompt_block_keys
from sarazmq.scheduler import LatencyModel, Request, Scheduler, build_scheduler
from sarazmq.sim.common import (
    DUMMY_TOKEN,
    SimClock,
    StandinPrompts,
    admit,
    collect,
    fewer_gc_passes,
    iteration_sample,
)


@dataclass
class ReplicaCounters:
    """One replica's share of a fleet run."""

    requests: int = 0
    iterations: int = 0
    busy_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(frozen=True)
class FleetOutcome:
    """records: one per workload request, in workload order; replicas: per replica;
    router: the router's counters; iterations: every replica's iterations (only with
    keep_iterations); sim_time_s: the last event's time; wall_s: real seconds taken."""

    records: list[RequestRecord]
    replicas: list[ReplicaCounters]
    router: dict[str, Any]
    sim_time_s: float
    wall_s: float
    num_iterations: int
    iterations: list[IterationSample] = field(default_factory=list)
    # a disaggregated deployment's KV transfers (count, bytes and link seconds; `disagg`)
    transfers: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        queries = sum(r.prefix_cache_queries for r in self.replicas)
        return sum(r.prefix_cache_hits for r in self.replicas) / queries if queries else 0.0

    def summary(
        self, slo_ttft: float | None = None, slo_tbt: float | None = None
    ) -> dict[str, Any]:
        """`summarize` of the records, with the prefix cache counted by the replicas'
        schedulers and the fleet's own numbers under "fleet"."""
        out = summarize(self.records, self.iterations, slo_ttft, slo_tbt)
        queries = sum(r.prefix_cache_queries for r in self.replicas)
        hits = sum(r.prefix_cache_hits for r in self.replicas)
        out["prefix_cache"] = {
            **out.get("prefix_cache", {}),
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries else None,
        }
        if out.get("iterations"):
            # busy is per replica: the fleet's busy time over N replicas' makespan
            it = out["iterations"]
            it["busy_fraction"] = self.fleet_summary()["busy_fraction"]["mean"]
        out["fleet"] = self.fleet_summary()
        return out

    def fleet_summary(self) -> dict[str, Any]:
        """The fleet's own numbers for summary.json (beside `summarize`'s)."""
        makespan = self.sim_time_s
        busy = [r.busy_s / makespan if makespan > 0 else 0.0 for r in self.replicas]
        reqs = [r.requests for r in self.replicas]
        return {
            "replicas": len(self.replicas),
            "router": {k: v for k, v in self.router.items() if k != "instances"},
            "prefix_hit_rate": self.prefix_hit_rate,
            "requests_per_replica": {"min": min(reqs), "max": max(reqs)},
            "busy_fraction": {
                "mean": sum(busy) / len(busy),
                "min": min(busy),
                "max": max(busy),
            },
            "num_iterations": self.num_iterations,
        } | ({"kv_transfers": self.transfers} if self.transfers else {})


@fewer_gc_passes
def simulate_fleet(
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    latency: LatencyModel,
    *,
    overhead_s: float = 0.0,
    progress: bool = False,
    exact_prompts: bool | None = None,
    keep_iterations: bool = False,
) -> FleetOutcome:
    """Simulates `config.data_parallel_size` replicas of `config` (resolved: its KV pool
    and context set, `sim.run.sim_engine_config`) behind a `config.router` router serving
    `requests` (arrival_s ascending). See the module docstring."""
    n_rep = config.data_parallel_size
    if config.pipeline_parallel_size != 1:
        raise ValueError("a fleet simulation runs replicas without pipeline stages (pp=1)")
    if not overhead_s >= 0:
        raise ValueError(f"overhead_s={overhead_s} must be >= 0")
    if config.scheduler.tbt_slo:
        raise ValueError("a fleet simulation runs fixed token budgets (no tbt_slo)")
    arrivals = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("requests must be sorted by arrival_s")
    wall0 = time.perf_counter()
    clocks = [SimClock(0.0) for _ in range(n_rep)]
    scheds: list[Scheduler] = [build_scheduler(config, (), clocks[i]) for i in range(n_rep)]
    router = build_router(config)
    table = router.table
    hash_keys = router.config.policy == "cache-aware"
    prompts = StandinPrompts(exact_prompts, config.cache.enable_prefix_caching, len(requests))
    counters = [ReplicaCounters() for _ in range(n_rep)]
    num_added = [0] * n_rep
    busy = [False] * n_rep
    events: list[tuple[float, int]] = []  # (end of a replica's iteration, replica)
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    live: list[dict[str, tuple[int, Request]]] = [{} for _ in range(n_rep)]
    samples: list[IterationSample] = []
    predict = latency.predict
    block_size = config.cache.block_size
    num_iterations = 0
    done = 0
    now = 0.0
    bar = tqdm(total=n, desc="simulate fleet", unit="req", disable=not progress)
    # per replica, its plan in flight: (step, start time, the seq ids it samples)
    pending_plans: list[tuple[int, float, list[int]]] = [(0, 0.0, [])] * n_rep

    def start(i: int, t: float) -> None:
        """Replica i plans its next iteration at t (if it has one)."""
        sched = scheds[i]
        clocks[i].now = t
        plan = sched.schedule()
        if plan is None:
            busy[i] = False
            return
        dt = predict(sched.inflight_shape) + overhead_s
        busy[i] = True
        heapq.heappush(events, (t + dt, i))
        pending_plans[i] = (plan.step, t, [s.seq_id for s in plan.scheduled if s.sample])

    nxt = 0
    try:
        while nxt < n or events:
            if nxt < n and (not events or arrivals[nxt] <= events[0][0]):
                now = arrivals[nxt]
                wr = requests[nxt]
                ids = prompts(nxt, wr)
                keys = prompt_block_keys(ids, block_size) if hash_keys else []
                i = router.route(keys, len(ids))
                clocks[i].now = now
                num_added[i] += 1
                counters[i].requests += 1
                error = admit(scheds[i], wr, nxt, ids, now, live[i])
                if error is not None:
                    records[nxt] = error
                    done += 1
                table.on_report(scheds[i].load(i, num_added[i]))
                nxt += 1
                if not busy[i]:
                    start(i, now)
                continue
            end, i = heapq.heappop(events)
            now = end
            sched = scheds[i]
            clocks[i].now = end
            step, began, sampled = pending_plans[i]
            deltas = sched.process_result(
                StepResult(
                    step=step,
                    seq_ids=sampled,
                    token_ids=[DUMMY_TOKEN] * len(sampled),
                    forward_s=end - began,
                )
            )
            num_iterations += 1
            counters[i].iterations += 1
            counters[i].busy_s += end - began
            if keep_iterations:
                for rec in sched.iterations_since(step):
                    samples.append(iteration_sample(rec, end - began))
            finished = collect(deltas, live[i], records, requests)
            if finished:
                done += finished
                if progress:
                    bar.update(finished)
            table.on_report(sched.load(i, num_added[i]))
            start(i, end)
    finally:
        bar.close()
    for i, sched in enumerate(scheds):
        if sched.has_unfinished():
            raise RuntimeError(f"replica {i} has unfinished requests and nothing left to run")
        stats = sched.stats()
        counters[i].prefix_cache_queries = stats.prefix_cache_queries
        counters[i].prefix_cache_hits = stats.prefix_cache_hits
    if done != n or any(r is None for r in records):
        raise RuntimeError(f"{n - done} request(s) left no record")
    return FleetOutcome(
        records=[r for r in records if r is not None],
        replicas=counters,
        router=router.counters(),
        sim_time_s=now,
        wall_s=time.perf_counter() - wall0,
        num_iterations=num_iterations,
        iterations=samples,
    )
