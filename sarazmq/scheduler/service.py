"""The scheduler process's logic (socket-free): inbound control messages, plans, routing deltas.

Wraps `Scheduler` with what the process needs beyond scheduling: turning rejected
requests into error outputs for the frontend, telling the right detokenizer shard about
a request before its first delta, and batching each iteration's deltas per shard.
"""

from __future__ import annotations

import gc
import zlib
from collections import deque
from dataclasses import dataclass, field

import msgspec

from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import (
    ERROR_ENGINE,
    ERROR_INVALID,
    ERROR_OVERLOADED,
    FINISH_ERROR,
    ErrorType,
)
from sarazmq.protocol.engine import (
    Abort,
    AddPrefilled,
    AddRequest,
    DeltaBatch,
    DetokenizerAdd,
    DetokenizerDrop,
    DetokenizerInbound,
    FrontendInbound,
    HandOff,
    InstanceLoad,
    KVDone,
    OutputBatch,
    ReleaseKV,
    RequestDelta,
    ResetPrefixCache,
    SchedulerInbound,
    SourceDown,
    StatsAnswer,
    StatsQuery,
    StopStringHit,
)
from sarazmq.protocol.worker import BatchPlan, KVExport, KVPull, KVPulled, KVRelease, StepResult
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.transfers import KVSource
from sarazmq.validation import InvalidRequestError

# The scheduler loop allocates a few objects per running request per iteration (deltas,
# plan entries, token lists), all freed by reference counting. At the default gen-0
# threshold (700) the cycle collector ran several times an iteration at 256 running, and
# its older generations walked every live request: a tenth of the per-iteration
# overhead in scripts/bench_ipc.py.
SCHEDULER_GC_THRESHOLDS = (10_000, 10, 10)


def configure_scheduler_gc() -> None:
    """Sets the scheduler process's cycle-collector thresholds, once at startup, after
    moving what startup made (modules, configs) out of the collector's view."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SCHEDULER_GC_THRESHOLDS)


def detokenizer_shard(request_id: str, num_shards: int) -> int:
    """Stable across processes (unlike hash(), which is salted per process)."""
    return zlib.crc32(request_id.encode()) % num_shards


@dataclass
class SchedulerActions:
    """What the process loop must send: to the detokenizer shards, to the frontend, and
    to every worker (a disaggregated deployment's KV exports and pulls)."""

    to_detokenizers: dict[int, list[DetokenizerInbound]] = field(default_factory=dict)
    to_frontend: list[FrontendInbound] = field(default_factory=list)
    to_workers: list[KVExport | KVRelease | KVPull] = field(default_factory=list)

    def detok(self, shard: int, msg: DetokenizerInbound) -> None:
        self.to_detokenizers.setdefault(shard, []).append(msg)


class SchedulerService:
    """Everything the scheduler process decides, without its sockets."""

    def __init__(self, scheduler: Scheduler, num_detokenizers: int, instance: int = 0) -> None:
        self.scheduler = scheduler
        self.num_detokenizers = num_detokenizers
        # this scheduler's engine instance, and the AddRequests it received (refused ones
        # too): what its load reports tell the frontend's router
        self.instance = instance
        self.num_added = 0
        # plans sent and not answered yet, oldest first (at most scheduler.max_inflight)
        self.in_flight: deque[BatchPlan] = deque()
        # control messages that arrive while a plan is in flight wait for the next result
        self.deferred: list[SchedulerInbound] = []
        # detokenizer shard of each request with deltas routed and its last one not yet
        self._shard_of: dict[str, int] = {}

    @property
    def can_plan(self) -> bool:
        """Whether another plan may be sent now (fewer than max_inflight in flight)."""
        return self.scheduler.can_schedule()

    def on_inbound(self, msg: SchedulerInbound, acts: SchedulerActions) -> None:
        if self.in_flight and isinstance(msg, (Abort, StopStringHit, ResetPrefixCache)):
            self.deferred.append(msg)
            return
        self._apply(msg, acts)

    def load(self) -> InstanceLoad:
        """This instance's load, for the frontend's router."""
        return self.scheduler.load(self.instance, self.num_added)

    def _apply(self, msg: SchedulerInbound, acts: SchedulerActions) -> None:
        if isinstance(msg, AddRequest):
            self.num_added += 1
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
        elif isinstance(msg, AddPrefilled):
            self._add_prefilled(msg, acts)
        elif isinstance(msg, SourceDown):
            for req in self.scheduler.source_down(msg.instance):
                error = f"the prefill instance with the prompt's KV failed: {msg.reason}"
                acts.to_frontend.append(_error_output(req.request_id, error, "", ERROR_ENGINE))
                shard = detokenizer_shard(req.request_id, self.num_detokenizers)
                acts.detok(shard, DetokenizerDrop(req.request_id))
        elif isinstance(msg, ReleaseKV):
            if self.scheduler.release_parked(msg.request_id):
                acts.to_workers.append(KVRelease(msg.request_id))
        elif isinstance(msg, Abort):
            if msg.request_id in self.scheduler.parking.parked:
                acts.to_workers.append(KVRelease(msg.request_id))
            self.scheduler.abort(msg.request_id)
        elif isinstance(msg, StopStringHit):
            self.scheduler.finish_by_stop_string(msg.request_id)
        elif isinstance(msg, ResetPrefixCache):
            ok, why = self.scheduler.reset_prefix_cache()
            acts.to_frontend.append(StatsAnswer(msg.request_id, {"reset": ok, "error": why}))
        elif isinstance(msg, StatsQuery):
            acts.to_frontend.append(StatsAnswer(msg.request_id, self.stats(msg.iterations_from)))
        self._route(self.scheduler.drain_finished(), acts)
        self._transfers(acts)

    def _add_prefilled(self, msg: AddPrefilled, acts: SchedulerActions) -> None:
        """A handed-off request arrives at a decode instance: queued for blocks and its
        KV; its detokenizer goes on from the first token, which was streamed already."""
        self.num_added += 1
        source = KVSource(msg.source_instance, msg.source_request_id, msg.source_block_ids)
        try:
            self.scheduler.add_prefilled_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                first_token=msg.first_token,
                first_token_time=msg.first_token_time,
                first_scheduled_time=msg.first_scheduled_time,
                arrival_time=msg.arrival_time,
                source=source,
            )
        except InvalidRequestError as e:
            acts.to_frontend.append(_error_output(msg.request_id, e.message, e.field))
            acts.to_frontend.append(KVDone(msg.request_id, source.instance, source.request_id))
            return
        acts.detok(
            detokenizer_shard(msg.request_id, self.num_detokenizers),
            DetokenizerAdd(
                msg.request_id, msg.prompt_token_ids, msg.params, replay_token_ids=[msg.first_token]
            ),
        )

    def on_kv_pulled(self, msg: KVPulled, acts: SchedulerActions) -> None:
        """A worker's report of a pull: once every rank has, the source may free its copy;
        a failed pull ends its request with the error."""
        done = self.scheduler.kv_pulled(msg.seq_id, msg.rank, msg.error, msg.nbytes, msg.seconds)
        if done is not None:
            req, source, err = done
            acts.to_frontend.append(KVDone(req.request_id, source.instance, source.request_id))
            if err and err != "cancelled":
                error = f"could not receive the prompt's KV from instance {source.instance}: {err}"
                acts.to_frontend.append(_error_output(req.request_id, error, "", ERROR_ENGINE))
                shard = detokenizer_shard(req.request_id, self.num_detokenizers)
                acts.detok(shard, DetokenizerDrop(req.request_id))
        self._transfers(acts)

    def _transfers(self, acts: SchedulerActions) -> None:
        """A disaggregated deployment's side work after every message: a prefill instance
        hands off the requests it parked (their KV exported to its workers, the frontend
        told, their detokenizer state dropped); a decode instance starts the pulls that
        now fit."""
        sched = self.scheduler
        if sched.role == "prefill":
            for req in sched.take_handoffs():
                acts.to_workers.append(KVExport(req.request_id, list(req.block_ids)))
                acts.to_frontend.append(
                    HandOff(
                        req.request_id,
                        req.prompt_token_ids,
                        req.params,
                        req.arrival_time,
                        req.output_token_ids[0],
                        req.token_times[0],
                        req.first_scheduled_time or req.arrival_time,
                        list(req.block_ids),
                        self.instance,
                    )
                )
                shard = self._shard_of.pop(req.request_id, None)
                if shard is None:
                    shard = detokenizer_shard(req.request_id, self.num_detokenizers)
                acts.detok(shard, DetokenizerDrop(req.request_id))
        elif sched.role == "decode":
            acts.to_workers.extend(sched.start_pulls())

    def stats(self, iterations_from: int = -1) -> dict[str, object]:
        out: dict[str, object] = msgspec.structs.asdict(self.scheduler.stats())
        if iterations_from >= 0:
            out["iterations"] = [
                msgspec.structs.asdict(r) for r in self.scheduler.iterations_since(iterations_from)
            ]
        return out

    def next_plan(self) -> BatchPlan | None:
        """The next plan to send (None: nothing can run now). RuntimeError when
        max_inflight plans are in flight already."""
        if not self.can_plan:
            raise RuntimeError(f"{len(self.in_flight)} plans are already in flight")
        plan = self.scheduler.schedule()
        if plan is not None:
            self.in_flight.append(plan)
        return plan

    def on_result(self, result: StepResult, acts: SchedulerActions) -> None:
        """Applies the result of the oldest plan in flight (RuntimeError for any other),
        then the control messages deferred while it ran."""
        if not self.in_flight or result.step != self.in_flight[0].step:
            raise RuntimeError(
                f"result for step {result.step} but the oldest plan in flight is "
                f"{self.in_flight[0].step if self.in_flight else None}"
            )
        self.in_flight.popleft()
        self._route(self.scheduler.process_result(result), acts)
        # an abort / stop applies between results: the scheduler skips a finished request
        # still in a later plan in flight, and workers run plans in order, so its blocks
        # are written by that plan before any later plan reuses them
        deferred, self.deferred = self.deferred, []
        for msg in deferred:
            self._apply(msg, acts)
        self._transfers(acts)

    def _route(self, deltas: list[RequestDelta], acts: SchedulerActions) -> None:
        if self.num_detokenizers == 1:
            if deltas:
                acts.detok(0, DeltaBatch(deltas))
            return
        shards: dict[int, list[RequestDelta]] = {}
        shard_of = self._shard_of  # the crc32 of a request id once, not per token
        for d in deltas:
            last = bool(d.finish_reason)  # a request's last delta forgets its shard
            shard = shard_of.pop(d.request_id, None) if last else shard_of.get(d.request_id)
            if shard is None:
                shard = detokenizer_shard(d.request_id, self.num_detokenizers)
                if not last:
                    shard_of[d.request_id] = shard
            shards.setdefault(shard, []).append(d)
        for shard, batch in shards.items():
            acts.detok(shard, DeltaBatch(batch))


def _error_output(
    request_id: str, error: str, field_name: str, error_type: ErrorType = ERROR_INVALID
) -> OutputBatch:
    """A request's final output when it ends with an error here."""
    return OutputBatch(
        [
            OutputDelta(
                request_id=request_id,
                finish_reason=FINISH_ERROR,
                error=error,
                error_field=field_name,
                error_type=error_type,
            )
        ]
    )
