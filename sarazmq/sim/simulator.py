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
from dataclasses import dataclass, field

import msgspec
from tqdm import tqdm

from sarazmq.perf.model import LatencyModel
from sarazmq.perf.pipeline import PipelineLatency
from sarazmq.perf.shape import IterationShape
from sarazmq.protocol.engine import RequestDelta
from sarazmq.protocol.worker import StepResult
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.request import Request
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.stats import IterationRecord
from sarazmq.sim.pipeline import PipelineStats, Span, pipeline_stats, simulate_pipeline
from sarazmq.validation import InvalidRequestError

#: The token every simulated step samples (not an EOS: requests run with ignore_eos).
DUMMY_TOKEN = 1
#: Stand-in prompts draw from ids below this (any real vocabulary is larger).
_STANDIN_BASE = 256


@dataclass(frozen=True)
class SimOutcome:
    """Everything a simulation produced.

    records: one per workload request, in workload order (errors: refused requests).
    iterations: every iteration, in order (forward_s = its simulated duration).
    sim_time_s: the simulated clock at the end (last token of the run).
    wall_s: real seconds the simulation took.
    num_iterations: len(iterations).
    pipeline: the stages' busy time and bubble fraction (`sim.pipeline`; one stage without
        pipeline parallelism, bubble 0). None only where an outcome was built by hand.
    stage_spans: per iteration (as `iterations`), each stage's busy (start, end).
    """

    records: list[RequestRecord]
    iterations: list[IterationSample]
    sim_time_s: float
    wall_s: float
    num_iterations: int
    pipeline: PipelineStats | None = None
    stage_spans: list[tuple[Span, ...]] = field(default_factory=list)


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


class SimClock:
    """The simulated clock: a callable, as the scheduler's `clock` argument wants."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class _Prompts:
    """Makes each request's prompt ids at its arrival (see the module docstring)."""

    def __init__(self, exact: bool | None, caching: bool, num_requests: int) -> None:
        self._exact = exact
        self._caching = caching
        self._base: list[int] = []
        # fixed-width headers: no header is a prefix of another
        self._width = 1
        while _STANDIN_BASE**self._width < num_requests:
            self._width += 1

    def _slice(self, n: int) -> list[int]:
        if len(self._base) < n:
            self._base = [i % _STANDIN_BASE for i in range(max(n, 2 * len(self._base)))]
        return self._base[:n]

    def __call__(self, index: int, req: WorkloadRequest) -> list[int]:
        exact = self._exact
        if exact is None:
            exact = self._caching and bool(req.hash_ids) and req.prompts is not None
        if exact:
            return req.prompt_token_ids
        n = req.input_tokens
        if not self._caching:
            return self._slice(n)
        # a unique header (the index in base 256) makes every full block key of this
        # prompt unique: keys chain, so they differ from the header's block on
        header = [(index // _STANDIN_BASE**k) % _STANDIN_BASE for k in range(self._width)]
        return (header + self._slice(n))[:n]


def _sample(rec: IterationRecord, duration: float) -> IterationSample:
    return IterationSample.from_record(msgspec.structs.asdict(rec), forward_s=duration)


def _record(req: Request, wr: WorkloadRequest) -> RequestRecord:
    return RequestRecord(
        request_id=wr.request_id,
        arrival_s=req.arrival_time,
        server_arrival_s=req.arrival_time,
        first_scheduled_s=req.first_scheduled_time,
        token_times_s=req.token_times,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        finish_reason=req.finish_reason or None,
        num_preemptions=req.num_preemptions,
    )


def _error_record(wr: WorkloadRequest, arrival: float, error: str) -> RequestRecord:
    return RequestRecord(
        request_id=wr.request_id,
        arrival_s=arrival,
        server_arrival_s=None,
        first_scheduled_s=None,
        token_times_s=[],
        num_prompt_tokens=wr.input_tokens,
        num_output_tokens=0,
        error=error,
    )


def _admit(
    scheduler: Scheduler,
    wr: WorkloadRequest,
    index: int,
    prompts: _Prompts,
    arrival: float,
    live: dict[str, tuple[int, Request]],
) -> RequestRecord | None:
    """Adds an arrived request to the scheduler (and to `live`); the error record of a
    request the scheduler refuses, else None."""
    try:
        scheduler.add_request(
            wr.request_id,
            prompts(index, wr),
            SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True, temperature=0.0),
            arrival_time=arrival,
        )
    except InvalidRequestError as e:
        return _error_record(wr, arrival, f"InvalidRequestError: {e}")
    req = scheduler.get_request(wr.request_id)
    assert req is not None  # just added
    live[wr.request_id] = (index, req)
    return None


def _collect(
    deltas: Sequence[RequestDelta],
    live: dict[str, tuple[int, Request]],
    records: list[RequestRecord | None],
    requests: Sequence[WorkloadRequest],
) -> int:
    """Records the requests these deltas finish (not scheduler-internal ones); how many."""
    finished = 0
    for d in deltas:
        if d.finish_reason and d.request_id in live:
            i, req = live.pop(d.request_id)
            records[i] = _record(req, requests[i])
            finished += 1
    return finished


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
    if not overhead_s >= 0:
        raise ValueError(f"overhead_s={overhead_s} must be >= 0")
    if scheduler.inflight or scheduler.stats().num_iterations:
        raise ValueError("simulate needs a fresh scheduler (it has run iterations)")
    arrivals = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("requests must be sorted by arrival_s")
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
    prompts = _Prompts(exact_prompts, scheduler.blocks.enable_caching, len(requests))
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
                error = _admit(scheduler, requests[nxt], nxt, prompts, arrivals[nxt], live)
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
                iterations.append(_sample(rec, dt))
            intervals.append((now, clock.now))
            finished = _collect(deltas, live, records, requests)
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
