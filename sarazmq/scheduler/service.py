"""The scheduler process's logic (socket-free): inbound control messages, plans, routing deltas.

Wraps `Scheduler` with what the process needs beyond scheduling: turning rejected
requests into error outputs for the frontend, telling the right detokenizer shard about
a request before its first delta, and batching each iteration's deltas per shard.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import msgspec

from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import ERROR_INVALID, ERROR_OVERLOADED, FINISH_ERROR
from sarazmq.protocol.engine import (
    Abort,
    AddRequest,
    DeltaBatch,
    DetokenizerAdd,
    OutputBatch,
    RequestDelta,
    ResetPrefixCache,
    SchedulerInbound,
    StatsAnswer,
    StatsQuery,
    StopStringHit,
)
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.validation import InvalidRequestError


def detokenizer_shard(request_id: str, num_shards: int) -> int:
    """Stable across processes (unlike hash(), which is salted per process)."""
    return zlib.crc32(request_id.encode()) % num_shards


@dataclass
class SchedulerActions:
    to_detokenizers: dict[int, list[DetokenizerAdd | DeltaBatch]] = field(default_factory=dict)
    to_frontend: list[OutputBatch | StatsAnswer] = field(default_factory=list)

    def detok(self, shard: int, msg: DetokenizerAdd | DeltaBatch) -> None:
        self.to_detokenizers.setdefault(shard, []).append(msg)


class SchedulerService:
    """Everything the scheduler process decides, without its sockets."""

    def __init__(self, scheduler: Scheduler, num_detokenizers: int) -> None:
        self.scheduler = scheduler
        self.num_detokenizers = num_detokenizers
        self.in_flight: BatchPlan | None = None
        # control messages that arrive while a plan is in flight wait for its result
        self.deferred: list[SchedulerInbound] = []

    def on_inbound(self, msg: SchedulerInbound, acts: SchedulerActions) -> None:
        if self.in_flight is not None and isinstance(msg, (Abort, StopStringHit, ResetPrefixCache)):
            self.deferred.append(msg)
            return
        if isinstance(msg, AddRequest):
            max_waiting = self.scheduler.config.max_waiting
            if max_waiting and len(self.scheduler.waiting) >= max_waiting:
                reply = OutputDelta(
                    request_id=msg.request_id,
                    finish_reason=FINISH_ERROR,
                    error=f"overloaded: {len(self.scheduler.waiting)} requests are already "
                    f"waiting (max_waiting={max_waiting}); retry later",
                    error_type=ERROR_OVERLOADED,
                )
                acts.to_frontend.append(OutputBatch([reply]))
                return
            try:
                self.scheduler.add_request(
                    msg.request_id, msg.prompt_token_ids, msg.params, arrival_time=msg.arrival_time
                )
            except InvalidRequestError as e:
                reply = OutputDelta(
                    request_id=msg.request_id,
                    finish_reason=FINISH_ERROR,
                    error=e.message,
                    error_field=e.field,
                    error_type=ERROR_INVALID,
                )
                acts.to_frontend.append(OutputBatch([reply]))
                return
            acts.detok(
                detokenizer_shard(msg.request_id, self.num_detokenizers),
                DetokenizerAdd(msg.request_id, msg.prompt_token_ids, msg.params),
            )
        elif isinstance(msg, Abort):
            self.scheduler.abort(msg.request_id)
        elif isinstance(msg, StopStringHit):
            self.scheduler.finish_by_stop_string(msg.request_id)
        elif isinstance(msg, ResetPrefixCache):
            ok, why = self.scheduler.reset_prefix_cache()
            acts.to_frontend.append(StatsAnswer(msg.request_id, {"reset": ok, "error": why}))
        elif isinstance(msg, StatsQuery):
            acts.to_frontend.append(StatsAnswer(msg.request_id, self.stats(msg.iterations_from)))
        self._route(self.scheduler.drain_finished(), acts)

    def stats(self, iterations_from: int = -1) -> dict[str, object]:
        out: dict[str, object] = msgspec.structs.asdict(self.scheduler.stats())
        if iterations_from >= 0:
            out["iterations"] = [
                msgspec.structs.asdict(r) for r in self.scheduler.iterations_since(iterations_from)
            ]
        return out

    def next_plan(self) -> BatchPlan | None:
        if self.in_flight is not None:
            raise RuntimeError("a plan is already in flight")
        plan = self.scheduler.schedule()
        self.in_flight = plan
        return plan

    def on_result(self, result: StepResult, acts: SchedulerActions) -> None:
        if self.in_flight is None or result.step != self.in_flight.step:
            raise RuntimeError(f"result for step {result.step} but none of that step is in flight")
        self.in_flight = None
        self._route(self.scheduler.process_result(result), acts)
        deferred, self.deferred = self.deferred, []
        for msg in deferred:
            self.on_inbound(msg, acts)

    def _route(self, deltas: list[RequestDelta], acts: SchedulerActions) -> None:
        if self.num_detokenizers == 1:
            if deltas:
                acts.detok(0, DeltaBatch(deltas))
            return
        shards: dict[int, list[RequestDelta]] = {}
        for d in deltas:
            shards.setdefault(detokenizer_shard(d.request_id, self.num_detokenizers), []).append(d)
        for shard, batch in shards.items():
            acts.detok(shard, DeltaBatch(batch))
