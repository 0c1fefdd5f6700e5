"""A discrete-event simulation of serving: the real scheduler, simulated time.

`simulate` drives a real `sarazmq.scheduler.Scheduler` (its policy, block manager and
prefix cache; nothing of theirs is copied here) through the same protocol the engine
uses, but instead of running a model it asks a `LatencyModel` how long each planned
iteration takes and advances a simulated clock by that much:

    add every request that has arrived by now (its true arrival time)
    plan = scheduler.schedule()             # None: idle, jump to the next arrival
    now += latency.predict(scheduler.inflight_shape) + overhead_s
    scheduler.process_result(one dummy non-EOS token per sampling entry)

Tokens arrive at the end of their iteration. Requests are sent as replay sends them
(`max_tokens=output_tokens`, `ignore_eos=True`, greedy), so each finishes by length.
The outcome holds the same `RequestRecord`s and `IterationSample`s as a replay, so
`summarize` and `write_run` work on it unchanged; times are simulated seconds from 0.

Prompt ids: the scheduler only looks at their count, except the prefix cache, which
keys blocks by content. So unless they can matter (prefix caching on and the request
has trace hash_ids), prompts are cheap stand-ins made at arrival: one shared list's
slice (caching off), or that slice behind a per-request header so no two prompts share
a block (caching on: as the replay's random prompts, which never collide). With hash
ids and caching on, the workload's real `PromptSource` ids are used, so the cache sees
the trace's reuse.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from sarazmq.perf.pipeline import PipelineLatency
from sarazmq.protocol.worker import StepResult
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.scheduler import IterationShape, LatencyModel, Request, Scheduler
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
from sarazmq.sim.pipeline import Span, pipeline_stats, simulate_pipeline


class ReplayLatency:
    """A latency model that returns given durations in order, whatever the shape (to
    replay a real run's iteration times; raises IndexError when they run out)."""

    def __init__(self, durations: Sequence[float]) -> None:
        self._durations = [float(d) for d in durations]
        if any(not d >= 0 for d in self._durations):
            raise ValueError("ReplayLatency durations must be >= 0")
        self._next = 0

    @property
    def num_used(self) -> int:
        """How many durations have been handed out."""
        return self._next

    def predict(self, shape: IterationShape) -> float:
        if self._next >= len(self._durations):
            raise IndexError(
                f"ReplayLatency: iteration {self._next + 1} asked for a duration, only "
                f"{len(self._durations)} were given"
            )
        d = self._durations[self._next]
        self._next += 1
        return d


@fewer_gc_passes
def simulate(
    requests: Sequence[WorkloadRequest],
    scheduler: Scheduler,
    latency: LatencyModel,
    *,
    overhead_s: float = 0.0,
    progress: bool = False,
    exact_prompts: bool | None = None,
) -> SimOutcome:
    """Simulates serving `requests` (arrival_s ascending, as `build_workload` makes them)
    with `scheduler` and iteration times from `latency` (see the module docstring).

    The scheduler must be fresh (no iteration run yet; a TBT budget's internal calibration
    requests may wait). Its clock becomes the simulated one, starting at 0: the scheduler's
    own `SimClock` if it was built with one (required under a TBT budget, which keeps the
    clock it was built with), else one set as its `clock`. overhead_s: added to every
    iteration's predicted time.
    exact_prompts: True: always the workload's real prompt ids; False: always stand-ins;
    None: real ids only where the prefix cache could see their sharing.
    A `PipelineLatency` with pp > 1 simulates that pipeline (`sim.pipeline`; the scheduler
    must allow pp plans in flight).
    """
    if isinstance(latency, PipelineLatency) and latency.pp > 1:
        return simulate_pipeline(
            requests,
            scheduler,
            latency,
            overhead_s=overhead_s,
            progress=progress,
            exact_prompts=exact_prompts,
        )
    arrivals = check_run_inputs(requests, scheduler, overhead_s)
    wall0 = time.perf_counter()
    if isinstance(scheduler.clock, SimClock):
        clock = scheduler.clock
        clock.now = 0.0
    elif getattr(scheduler, "budget", None) is not None:
        raise ValueError("a scheduler with a TBT budget must be built with clock=SimClock()")
    else:
        clock = SimClock(0.0)
        scheduler.clock = clock
    predict = latency.predict
    # a TBT budget's calibration runs before the first request, as in a deployment (where
    # it runs before the replay's warm-up): the workload's time starts after it
    while scheduler.calibrating:
        plan = scheduler.schedule()
        if plan is None:
            break
        clock.now += predict(scheduler.inflight_shape) + overhead_s
        sampled = [s.seq_id for s in plan.scheduled if s.sample]
        scheduler.process_result(
            StepResult(step=plan.step, seq_ids=sampled, token_ids=[DUMMY_TOKEN] * len(sampled))
        )
    offset = clock.now
    arrivals = [offset + a for a in arrivals]
    prompts = StandinPrompts(exact_prompts, scheduler.blocks.enable_caching, len(requests))
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    live: dict[str, tuple[int, Request]] = {}
    iterations: list[IterationSample] = []
    intervals: list[Span] = []  # each iteration's [start, end]: its one stage's busy span
    bar = tqdm(total=n, desc="simulate", unit="req", disable=not progress, dynamic_ncols=True)
    done = 0
    nxt = 0  # next request to arrive
    try:
        while True:
            now = clock.now
            while nxt < n and arrivals[nxt] <= now:
                wr = requests[nxt]
                error = admit(scheduler, wr, nxt, prompts(nxt, wr), arrivals[nxt], live)
                if error is not None:
                    records[nxt] = error
                    done += 1
                    if progress:
                        bar.update(1)
                nxt += 1
            plan = scheduler.schedule()
            if plan is None:
                if nxt < n:
                    clock.now = max(now, arrivals[nxt])
                    continue
                if scheduler.has_unfinished():
                    raise RuntimeError(
                        f"the scheduler planned nothing with {len(live)} request(s) "
                        "unfinished and none left to arrive"
                    )
                break
            dt = predict(scheduler.inflight_shape) + overhead_s
            clock.now = now + dt
            sampled = [s.seq_id for s in plan.scheduled if s.sample]
            deltas = scheduler.process_result(
                StepResult(
                    step=plan.step,
                    seq_ids=sampled,
                    token_ids=[DUMMY_TOKEN] * len(sampled),
                    forward_s=dt,
                )
            )
            for rec in scheduler.iterations_since(plan.step):
                iterations.append(iteration_sample(rec, dt))
            intervals.append((now, clock.now))
            finished = collect(deltas, live, records, requests)
            if finished:
                done += finished
                if progress:
                    bar.update(finished)
    finally:
        bar.close()
    if done != n or any(r is None for r in records):
        raise RuntimeError(f"{n - done} request(s) left no record")
    out = [r for r in records if r is not None]
    return SimOutcome(
        records=out,
        iterations=iterations,
        sim_time_s=clock.now,
        wall_s=time.perf_counter() - wall0,
        num_iterations=len(iterations),
        pipeline=pipeline_stats(intervals, [(span,) for span in intervals], 1),
        stage_spans=[(span,) for span in intervals],
    )
