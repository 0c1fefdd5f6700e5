"""What both simulation loops share (`simulator.simulate`, `pipeline.simulate_pipeline`):
the simulated clock, the outcome, the stand-in prompts, admitting arrived requests and
collecting finished ones, and the checks on a run's inputs."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import msgspec

from sarazmq.protocol.engine import RequestDelta
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import IterationRecord, Request, Scheduler
from sarazmq.validation import InvalidRequestError

if TYPE_CHECKING:
    from sarazmq.sim.pipeline import PipelineStats, Span

#: The token every simulated step samples (not an EOS: requests run with ignore_eos).
DUMMY_TOKEN = 1
#: Stand-in prompts draw from ids below this (any real vocabulary is larger).
STANDIN_BASE = 256


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


class SimClock:
    """The simulated clock: a callable, as the scheduler's `clock` argument wants."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class StandinPrompts:
    """Makes each request's prompt ids at its arrival (see the module docstring)."""

    def __init__(self, exact: bool | None, caching: bool, num_requests: int) -> None:
        self._exact = exact
        self._caching = caching
        self._base: list[int] = []
        # fixed-width headers: no header is a prefix of another
        self._width = 1
        while STANDIN_BASE**self._width < num_requests:
            self._width += 1

    def _slice(self, n: int) -> list[int]:
        if len(self._base) < n:
            self._base = [i % STANDIN_BASE for i in range(max(n, 2 * len(self._base)))]
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
        header = [(index // STANDIN_BASE**k) % STANDIN_BASE for k in range(self._width)]
        return (header + self._slice(n))[:n]


_P = ParamSpec("_P")
_R = TypeVar("_R")
#: the collector's thresholds while a simulation runs (Python's default: 700, 10, 10)
SIM_GC_THRESHOLDS = (100_000, 50, 100)


def fewer_gc_passes(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Runs `fn` with the cyclic collector's thresholds raised (SIM_GC_THRESHOLDS), then
    restores them. A simulation allocates millions of small objects that live to its end
    (token lists, requests, records) and frees few: at the default thresholds the
    collector walks them over and over for nothing (docs/SCALE_OUT.md, "Simulator
    speed"). Nothing here makes reference cycles that need prompt collection."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        before = gc.get_threshold()
        gc.set_threshold(*SIM_GC_THRESHOLDS)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(*before)

    return wrapper


def iteration_sample(rec: IterationRecord, duration: float) -> IterationSample:
    return IterationSample.from_record(msgspec.structs.asdict(rec), forward_s=duration)


def request_record(req: Request, wr: WorkloadRequest) -> RequestRecord:
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


def error_record(wr: WorkloadRequest, arrival: float, error: str) -> RequestRecord:
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


def admit(
    scheduler: Scheduler,
    wr: WorkloadRequest,
    index: int,
    prompt_ids: list[int],
    arrival: float,
    live: dict[str, tuple[int, Request]],
) -> RequestRecord | None:
    """Adds an arrived request (workload index `index`, its prompt `prompt_ids`: see
    `StandinPrompts`) to the scheduler and to `live`; the error record of a request the
    scheduler refuses, else None."""
    try:
        scheduler.add_request(
            wr.request_id,
            prompt_ids,
            SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True, temperature=0.0),
            arrival_time=arrival,
        )
    except InvalidRequestError as e:
        return error_record(wr, arrival, f"InvalidRequestError: {e}")
    req = scheduler.get_request(wr.request_id)
    assert req is not None  # just added
    live[wr.request_id] = (index, req)
    return None


def collect(
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
            records[i] = request_record(req, requests[i])
            finished += 1
    return finished


def check_run_inputs(
    requests: Sequence[WorkloadRequest], scheduler: Scheduler, overhead_s: float
) -> list[float]:
    """The requests' arrival times; ValueError for a negative overhead, a scheduler that
    has run iterations, or requests out of arrival order."""
    if not overhead_s >= 0:
        raise ValueError(f"overhead_s={overhead_s} must be >= 0")
    if scheduler.inflight or scheduler.stats().num_iterations:
        raise ValueError("simulate needs a fresh scheduler (it has run iterations)")
    arrivals = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("requests must be sorted by arrival_s")
    return arrivals
