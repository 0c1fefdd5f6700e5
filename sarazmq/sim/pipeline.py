"""Pipeline parallelism in simulated time: stages, micro-batches in flight, bubbles.

A deployment of `pp` stages runs each plan (a micro-batch) on stage 0, then stage 1, ...,
then the last stage, which samples. Stage s starts a micro-batch when it is free and the
micro-batch's activations have arrived from stage s - 1 (its end there plus the transfer
over the link between them; each link carries one transfer at a time). The scheduler
keeps up to `pp` plans in flight (a request in at most one); a plan's result is processed
when its last stage ends, oldest first.

The loop (`simulate_pipeline`), at the simulated time `now`:

    add every request that has arrived by now
    while fewer than pp plans are in flight and the scheduler plans one:
        put it on the stages (it starts on stage 0 once stage 0 is free)
    the next event: an arrival while a slot is free (go there and plan again), else the
        oldest plan's last stage ending: process its result there

Bubble fraction (the same as `sarazmq.scheduler.stats.bubble_fraction` on the real
engine): over the active time (the union of the plans' [scheduled, result] intervals:
time with at least one plan in flight), each stage's idle time is the active time less
what it computed; bubble_fraction = idle stage time / (pp x active time). With pp = 1 it is
0; time with nothing to run does not count (it is not a bubble of the pipeline).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from sarazmq.perf.pipeline import PipelineLatency
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.scheduler import Request, Scheduler, active_seconds, bubble_fraction_of
from sarazmq.sim.common import (
    DUMMY_TOKEN,
    SimClock,
    SimOutcome,
    StandinPrompts,
    admit,
    check_run_inputs,
    collect,
    fewer_gc_passes,
    iteration_sample,
)

#: one stage's busy interval (start, end) in simulated seconds
Span = tuple[float, float]


class StageTimeline:
    """When each stage and each inter-stage link is next free (simulated seconds)."""

    def __init__(self, pp: int) -> None:
        if pp < 1:
            raise ValueError(f"pp={pp} must be >= 1")
        self.stage_free = [0.0] * pp
        self.link_free = [0.0] * (pp - 1)

    def run(self, ready: float, stage_s: Sequence[float], transfer_s: float) -> tuple[Span, ...]:
        """Puts a micro-batch ready at `ready` through every stage (stage_s: its time on
        each) with `transfer_s` between consecutive stages; returns each stage's busy
        interval. ValueError when stage_s does not have one time per stage."""
        if len(stage_s) != len(self.stage_free):
            raise ValueError(f"{len(stage_s)} stage times for {len(self.stage_free)} stages")
        spans: list[Span] = []
        t = ready
        for s, dt in enumerate(stage_s):
            if s > 0:  # the activations cross link s - 1 once it is free
                send = max(t, self.link_free[s - 1])
                t = send + transfer_s
                self.link_free[s - 1] = t
            start = max(t, self.stage_free[s])
            t = start + dt
            self.stage_free[s] = t
            spans.append((start, t))
        return tuple(spans)


@dataclass(frozen=True)
class PipelineStats:
    """What the stages did over a run (see the module docstring for the bubble).

    pp: stages. active_s: time with at least one plan in flight. stage_busy_s: per stage,
    seconds computing. bubble_fraction: idle stage time / (pp x active_s).
    max_inflight: most plans in flight at once. num_micro_batches: plans run.
    """

    pp: int
    active_s: float
    stage_busy_s: tuple[float, ...]
    bubble_fraction: float
    max_inflight: int
    num_micro_batches: int

    def to_dict(self) -> dict[str, Any]:
        """The stats as a JSON-ready dict (a summary's "pipeline" entry)."""
        a = self.active_s
        return {
            "pp": self.pp,
            "active_s": a,
            "stage_busy_s": list(self.stage_busy_s),
            "stage_busy_fraction": [b / a if a > 0 else 0.0 for b in self.stage_busy_s],
            "bubble_fraction": self.bubble_fraction,
            "max_inflight": self.max_inflight,
            "num_micro_batches": self.num_micro_batches,
        }


def pipeline_stats(
    intervals: Sequence[Span], stage_spans: Sequence[Sequence[Span]], pp: int
) -> PipelineStats:
    """The stats of plans in flight over `intervals` ([scheduled, result] each) whose
    stages were busy over `stage_spans` (one interval per stage each)."""
    busy = [0.0] * pp
    for spans in stage_spans:
        if len(spans) != pp:
            raise ValueError(f"a micro-batch with {len(spans)} stage spans in a {pp}-stage run")
        for s, (a, b) in enumerate(spans):
            busy[s] += b - a
    active = active_seconds(intervals)
    return PipelineStats(
        pp=pp,
        active_s=active,
        stage_busy_s=tuple(busy),
        bubble_fraction=bubble_fraction_of(sum(busy), active, pp),
        max_inflight=_max_overlap(intervals),
        num_micro_batches=len(stage_spans),
    )


def _max_overlap(intervals: Sequence[Span]) -> int:
    """Most intervals open at once (one ending when another starts do not overlap)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = cur = 0
    for _, d in events:
        cur += d
        most = max(most, cur)
    return most


@dataclass
class _Flight:
    plan: BatchPlan
    scheduled: float
    spans: tuple[Span, ...]


@fewer_gc_passes
def simulate_pipeline(
    requests: Sequence[WorkloadRequest],
    scheduler: Scheduler,
    latency: PipelineLatency,
    *,
    overhead_s: float = 0.0,
    progress: bool = False,
    exact_prompts: bool | None = None,
) -> SimOutcome:
    """Simulates serving `requests` on a `latency.pp`-stage pipeline (module docstring);
    returns a `SimOutcome` with its `pipeline` stats. overhead_s is added to stage 0 of
    every micro-batch. The scheduler must be fresh, allow latency.pp plans in flight
    (`max_inflight`) and have no TBT budget (ValueError otherwise)."""
    pp = latency.pp
    if getattr(scheduler, "max_inflight", 1) < pp:
        raise ValueError(
            f"a {pp}-stage pipeline needs a scheduler with max_inflight >= {pp} (it has "
            f"{getattr(scheduler, 'max_inflight', 1)})"
        )
    if scheduler.budget is not None:
        raise ValueError("the adaptive TBT budget is not simulated with pipeline parallelism")
    arrivals = check_run_inputs(requests, scheduler, overhead_s)
    wall0 = time.perf_counter()
    clock = scheduler.clock if isinstance(scheduler.clock, SimClock) else SimClock()
    clock.now = 0.0
    scheduler.clock = clock
    prompts = StandinPrompts(exact_prompts, scheduler.blocks.enable_caching, len(requests))
    timeline = StageTimeline(pp)
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    live: dict[str, tuple[int, Request]] = {}
    iterations: list[IterationSample] = []
    intervals: list[Span] = []
    stage_spans: list[tuple[Span, ...]] = []
    flights: deque[_Flight] = deque()
    bar = tqdm(total=n, desc="simulate", unit="req", disable=not progress, dynamic_ncols=True)
    done = nxt = 0
    try:
        while True:
            now = clock.now
            while nxt < n and arrivals[nxt] <= now:
                wr = requests[nxt]
                error = admit(scheduler, wr, nxt, prompts(nxt, wr), arrivals[nxt], live)
                if error is not None:
                    records[nxt] = error
                    done += 1
                    bar.update(1)
                nxt += 1
            while scheduler.can_schedule():
                plan = scheduler.schedule()
                if plan is None:
                    break
                shape = scheduler.inflight_shape
                times = list(latency.stage_times(shape))
                times[0] += overhead_s
                spans = timeline.run(now, times, latency.transfer_s(shape))
                flights.append(_Flight(plan, now, spans))
            if not flights:
                if nxt < n:
                    clock.now = max(now, arrivals[nxt])
                    continue
                if scheduler.has_unfinished():
                    raise RuntimeError(
                        f"the scheduler planned nothing with {len(live)} request(s) "
                        "unfinished and none left to arrive"
                    )
                break
            head = flights[0]
            end = head.spans[-1][1]
            if nxt < n and arrivals[nxt] < end and scheduler.can_schedule():
                clock.now = max(now, arrivals[nxt])  # it may fill the free slot
                continue
            flights.popleft()
            clock.now = end
            plan = head.plan
            sampled = [s.seq_id for s in plan.scheduled if s.sample]
            busy = [b - a for a, b in head.spans]
            waits = [0.0] + [
                max(0.0, head.spans[s][0] - head.spans[s - 1][1]) for s in range(1, pp)
            ]
            deltas = scheduler.process_result(
                StepResult(
                    step=plan.step,
                    seq_ids=sampled,
                    token_ids=[DUMMY_TOKEN] * len(sampled),
                    forward_s=end - head.spans[0][0],
                    stage_busy_s=busy,
                    stage_wait_s=waits,
                )
            )
            for rec in scheduler.iterations_since(plan.step):
                if rec.step == plan.step:
                    iterations.append(iteration_sample(rec, end - head.spans[0][0]))
            intervals.append((head.scheduled, end))
            stage_spans.append(head.spans)
            finished = collect(deltas, live, records, requests)
            done += finished
            bar.update(finished)
    finally:
        bar.close()
    if done != n or any(r is None for r in records):
        raise RuntimeError(f"{n - done} request(s) left no record")
    return SimOutcome(
        records=[r for r in records if r is not None],
        iterations=iterations,
        sim_time_s=clock.now,
        wall_s=time.perf_counter() - wall0,
        num_iterations=len(iterations),
        pipeline=pipeline_stats(intervals, stage_spans, pp),
        stage_spans=stage_spans,
    )
