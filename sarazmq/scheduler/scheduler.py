"""The scheduler: request bookkeeping, batch policy, and the plan diff for the workers.

Pure and socket-free: the engine feeds it requests and step results and ships its
plans. Protocol, up to `max_inflight` plans in flight (1 unless pipeline parallel or
asynchronous scheduling; see `inflight`), results processed in the order the plans were
built:

    while scheduler.can_schedule() and (plan := scheduler.schedule()) is not None:
        ... send plan to the workers ...
    ... the last stage's driver answers the oldest plan with a StepResult ...
    deltas = scheduler.process_result(result)

Worker contract for a `BatchPlan` (the diff): first forget every seq in
`freed_seq_ids`, then create every `new_seqs` entry (token_ids = all tokens known,
empty block table, its first `num_cached_tokens` positions computed: their KV is in
the shared prefix-cache blocks that lead its first `new_block_ids`), then for each
`scheduled` entry append
`append_token_ids` to the seq's tokens and `new_block_ids` to its block table and
compute positions [start_pos, start_pos + num_tokens); if `sample`, the last one
yields the seq's next token. `scheduled` lists decodes first, then prefill chunks
(the attention metadata layout). Under asynchronous scheduling the worker appends each
token it samples to the seq itself (a later plan's decode may start from it before the
scheduler knows it), so `append_token_ids` never carries a sampled token there.

Finished requests: EOS / stop ids / length finishes come out of `process_result`.
`abort()` queues a finished delta (reason "abort"); it is returned by the next
`process_result()` or `drain_finished()`, whichever is called first.
`finish_by_stop_string()` emits no delta (the detokenizer that asked already knows).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from sarazmq.config import SchedulerConfig
from sarazmq.protocol.common import (
    FINISH_ABORT,
    FINISH_STOP,
    FinishReason,
)
from sarazmq.protocol.engine import InstanceLoad, RequestDelta
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.adaptive import (
    CALIBRATION_REQUESTS,
    build_adaptive_budget,
    calibration_requests,
)
from sarazmq.scheduler.block_manager import BlockManager
from sarazmq.scheduler.handoff import DisaggregationMixin
from sarazmq.scheduler.inflight import (
    InflightQueue,
    PolicyView,
    async_hidden_seq_ids,
    build_plan,
)
from sarazmq.scheduler.plan_check import check_result
from sarazmq.scheduler.policies import BatchDecision, ScheduleContext, make_policy
from sarazmq.scheduler.prefix_cache import BlockHashFn, PrefixCacheCounters, sha256_block_key
from sarazmq.scheduler.request import Request, RequestStatus
from sarazmq.scheduler.results import apply_result, finish_token_ids, request_delta
from sarazmq.scheduler.shape import IterationShape
from sarazmq.scheduler.stats import (
    MAX_ITERATION_RECORDS,
    IterationRecord,
    PipelineAccounting,
    SchedulerStats,
)
from sarazmq.scheduler.transfers import KVParking, KVPulls
from sarazmq.validation import InvalidRequestError, check_prompt_token_ids


class Scheduler(DisaggregationMixin):
    """Owns all requests, the KV block pool and the policy; builds diff plans."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        clock: Callable[[], float] = time.monotonic,
        *,
        seed: int | None = None,
        enable_prefix_caching: bool = False,
        block_hash_fn: BlockHashFn = sha256_block_key,
        max_inflight: int = 1,
        role: str = "mixed",
        world_size: int = 1,
        async_scheduling: bool = False,
    ) -> None:
        """seed: if given, the per-request seeds drawn for requests without
        params.seed come from a generator seeded with it (reproducible runs);
        otherwise from OS entropy.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (see
        `BlockManager`); off here by default, on by default in `CacheConfig`.
        block_hash_fn: the prefix cache's block key (tests pass a colliding stub).
        max_inflight: most plans in flight at once (the pipeline's stages; see
        `inflight`); ValueError when < 1.
        role: "mixed"; or in a disaggregated deployment "prefill" (a request is parked
        after its first token, for a decode instance to pull: `transfers`) or "decode";
        world_size: the workers that pull KV (each reports its pull).
        async_scheduling: build plan N+1 while plan N runs (two in flight, a request in
        both; see `inflight`); needs max_inflight 1 and role "mixed" (ValueError)."""
        if role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"unknown scheduler role {role!r}")
        if async_scheduling and (max_inflight != 1 or role != "mixed"):
            raise ValueError(
                f"async_scheduling needs one pipeline stage and a co-located instance (got "
                f"max_inflight={max_inflight}, role={role!r})"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.role = role
        self.blocks = BlockManager(
            block_size, num_blocks, enable_caching=enable_prefix_caching, hash_fn=block_hash_fn
        )
        self.parking = KVParking()  # a prefill instance's handed-off requests
        self.pulls = KVPulls(self.blocks, world_size)  # a decode instance's arrivals
        self.prefix_cache = PrefixCacheCounters()
        self.policy = make_policy(config, max_model_len)
        self._rng = random.Random(seed)
        self._watermark_blocks = int(config.watermark * num_blocks)

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # live (not finished) requests
        self._next_seq_id = 0
        self._step = 0
        self.async_scheduling = async_scheduling
        self._inflight = InflightQueue(2 if async_scheduling else max_inflight)
        self._last_shape = IterationShape()
        self._pipeline = PipelineAccounting(max_inflight)  # behind bubble_fraction
        # when the last result came in: with two plans in flight the next one runs from
        # then, not from when it was built
        self._last_result_time = 0.0
        self._num_overlapped_plans = 0
        self._pending_freed: list[int] = []
        self._pending_deltas: list[RequestDelta] = []
        self._num_preemptions = 0
        self._num_finished = 0
        # bounded: a long-running server must not grow without limit
        self.iteration_records: deque[IterationRecord] = deque(maxlen=MAX_ITERATION_RECORDS)
        self._num_iterations = 0
        # under a TBT target: the adaptive budget, and its calibration requests' seq ids
        self.budget = build_adaptive_budget(config, clock)
        self._calibration_seq_ids: set[int] = set()
        if self.budget is not None and self.budget.calibrating:
            self._start_calibration()

    # ---- requests in ----

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request (FCFS). Raises InvalidRequestError (a ValueError naming the
        field) for bad input.

        params.max_tokens is clamped so prompt + output <= max_model_len, and so the
        request fits the KV pool alone; reaching the clamp finishes with "length".
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(
                f"request_id must be a non-empty string, got {request_id!r}", "request_id"
            )
        if request_id in self._requests:
            raise InvalidRequestError(
                f"duplicate request_id {request_id!r}: a request with it is live", "request_id"
            )
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be SamplingParams, got {type(params).__name__}", "params"
            )
        slots = self.blocks.num_token_slots
        prompt = check_prompt_token_ids(
            prompt_token_ids, max_model_len=self.max_model_len, max_kv_tokens=slots
        )
        n = len(prompt)
        # positions with KV = prompt + outputs - 1 (the last output is never computed)
        max_out = min(params.max_tokens, self.max_model_len - n, slots - n + 1)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt_token_ids=prompt,
            params=params,
            seed=seed,
            max_output_tokens=max_out,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            finish_token_ids=finish_token_ids(
                params.stop_token_ids, params.ignore_eos, self.eos_token_ids
            ),
        )
        self._next_seq_id += 1
        self._requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Finishes a live request with "abort" and frees its blocks. Its delta comes
        out of the next process_result() or drain_finished(). False if not live."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FINISH_ABORT)
        self._pending_deltas.append(request_delta(req, [], [], []))
        return True

    def finish_by_stop_string(self, request_id: str) -> None:
        """The detokenizer matched a stop string: finish with "stop" and free blocks.
        No delta is emitted. A no-op if the request already finished."""
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, FINISH_STOP)

    def drain_finished(self) -> list[RequestDelta]:
        """Deltas of aborted requests not yet returned by process_result()."""
        out, self._pending_deltas = self._pending_deltas, []
        return out

    # ---- queries ----

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id (None once finished)."""
        return self._requests.get(request_id)

    @property
    def max_inflight(self) -> int:
        """Most plans in flight at once."""
        return self._inflight.max_inflight

    @property
    def inflight(self) -> bool:
        """Whether any plan is in flight."""
        return len(self._inflight) > 0

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def can_schedule(self) -> bool:
        """Whether schedule() may be called: fewer than max_inflight plans in flight."""
        return not self._inflight.full

    def inflight_shapes(self) -> list[IterationShape]:
        """The shapes of the plans in flight, oldest first."""
        return [entry.shape for entry in self._inflight]

    @property
    def calibrating(self) -> bool:
        """True while the adaptive budget's calibration requests run (they go first)."""
        return bool(self._calibration_seq_ids)

    @property
    def inflight_shape(self) -> IterationShape:
        """The shape of the newest plan scheduled (in flight, or its result is in)."""
        return self._last_shape

    @property
    def num_iterations(self) -> int:
        """Iterations whose result has been processed."""
        return self._num_iterations

    def load(self, instance: int, num_added: int) -> InstanceLoad:
        """This scheduler's load for a router (`sarazmq.router`): prefill tokens queued
        (waiting requests and running ones still in their prefill), running requests and
        KV use. instance / num_added: its index in the deployment and the AddRequests it
        has received (the caller counts them: rejected ones too)."""
        queued = 0
        for req in self.waiting:  # a prompt whose KV was sent needs no computing
            queued += req.num_uncomputed_tokens - req.num_transferred_tokens
        for req in self.running:
            if req.is_prefill:
                queued += req.num_uncomputed_tokens
        return InstanceLoad(
            instance=instance,
            num_added=num_added,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            queued_prefill_tokens=queued,
            kv_used_blocks=self.blocks.num_used_blocks,
            kv_total_blocks=self.blocks.num_total_blocks,
        )

    def stats(self) -> SchedulerStats:
        pc = self.prefix_cache
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_total_blocks,
            num_iterations=self._num_iterations,
            num_preemptions=self._num_preemptions,
            num_finished=self._num_finished,
            prefix_caching=self.blocks.enable_caching,
            num_cached_blocks=self.blocks.num_cached_blocks,
            num_evictions=self.blocks.num_evictions,
            prefix_cache_requests=pc.requests,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            prefix_cache_preempted_requests=pc.preempted_requests,
            prefix_cache_preempted_queries=pc.preempted_queries,
            prefix_cache_preempted_hits=pc.preempted_hits,
            kv_pulls=self.pulls.num_done,
            kv_pull_bytes=self.pulls.done_bytes,
            kv_pull_seconds=self.pulls.done_seconds,
            num_parked=len(self.parking.parked),
            async_scheduling=self.async_scheduling,
            num_overlapped_plans=self._num_overlapped_plans,
            **(self.budget.stats_fields() if self.budget is not None else {}),
            # the clock is read only while busy: stats() of an idle scheduler reads none
            **self._pipeline.fields(self.clock() if self.inflight else 0.0, self.inflight),
        )

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Forgets every cached block key. Refused, (False, why), while any request
        holds KV blocks (running, or a plan in flight): reset an idle engine."""
        if self._inflight:
            return False, "a plan is in flight; reset_prefix_cache needs an idle engine"
        return self.blocks.reset_cache()

    def iterations_since(self, step: int) -> list[IterationRecord]:
        """Iteration records with step >= `step` (the most recent ones are kept)."""
        out: list[IterationRecord] = []
        for rec in reversed(self.iteration_records):
            if rec.step < step:
                break
            out.append(rec)
        out.reverse()
        return out

    # ---- the iteration ----

    def schedule(self) -> BatchPlan | None:
        """Builds the next plan, or None when there is nothing to run now (requests in
        a plan in flight are not scheduled again until its result is in, except under
        asynchronous scheduling: see `inflight`). Raises RuntimeError when max_inflight
        plans are in flight (see `can_schedule`)."""
        if self._inflight.full:
            oldest = self._inflight.oldest()
            step = oldest.plan.step if oldest is not None else -1
            raise RuntimeError(
                f"schedule() called with {len(self._inflight)} plans in flight (oldest step "
                f"{step}, max_inflight={self.max_inflight}); call process_result() first"
            )
        start = self.clock()
        hidden = async_hidden_seq_ids(self.running) if self.async_scheduling else set()
        if hidden:
            decision, num_preempted = self._decide_in_view(len(self.running), hidden)
        elif self.max_inflight == 1 or self.async_scheduling:
            decision, num_preempted = self._decide(self._context(self.running, 0))
        else:
            # micro-batches: the policy sees only requests not in flight, first its share
            # of them, then (when that share alone cannot run) all of them
            share = -(-len(self.running) // self.max_inflight)
            inflight = self._inflight.seq_ids
            decision, num_preempted = self._decide_in_view(share, inflight)
            if decision.empty and any(r.seq_id not in inflight for r in self.running):
                decision, more = self._decide_in_view(len(self.running), inflight)
                num_preempted += more
        if decision.empty:
            return None
        return self._build_plan(decision, start, num_preempted)

    def _context(self, running: list[Request], hidden: int) -> ScheduleContext:
        return ScheduleContext(
            waiting=self.waiting,
            running=running,
            blocks=self.blocks,
            max_num_seqs=self.config.max_num_seqs - hidden,
            watermark_blocks=self._watermark_blocks,
            prefill_budget=self.budget.prefill_budget if self.budget is not None else None,
            num_hidden=hidden,
        )

    def _decide_in_view(self, share: int, hidden: set[int]) -> tuple[BatchDecision, int]:
        """`_decide` over a `PolicyView` showing at most `share` running requests, none
        of those in `hidden`."""
        view = PolicyView(self.running, hidden, share)
        try:
            return self._decide(self._context(view.running, view.num_hidden))
        finally:
            view.merge()

    def _decide(self, ctx: ScheduleContext) -> tuple[BatchDecision, int]:
        """The policy's decision and how many requests it preempted on the way."""
        decision = self.policy.schedule(ctx)
        num_preempted = len(decision.preempted)
        self._note_preempted(decision)
        if decision.empty and decision.preempted:
            # preemption emptied the batch; with the victims back in waiting, a fresh
            # pass can admit (policies do not admit in a step that preempted)
            decision = self.policy.schedule(ctx)
            num_preempted += len(decision.preempted)
            self._note_preempted(decision)
        return decision, num_preempted

    def _build_plan(self, decision: BatchDecision, start: float, num_preempted: int) -> BatchPlan:
        self._step += 1
        entry = build_plan(
            decision,
            self._step,
            self._pending_freed,
            start,
            num_preempted,
            self.prefix_cache,
            optimistic=self.async_scheduling,
        )
        self._pending_freed = []
        self._last_shape = entry.shape
        if self._inflight:
            self._num_overlapped_plans += 1
        self._pipeline.plan_sent(start, was_idle=not self._inflight)
        self._inflight.push(entry)
        return entry.plan

    def process_result(self, result: StepResult) -> list[RequestDelta]:
        """Applies the result of the oldest plan in flight (results come in the order
        the plans were built): advances computed tokens, appends the sampled tokens,
        finishes requests. Returns one delta per request that got a token or finished
        (pending abort deltas first).

        Raises RuntimeError when no plan is in flight or the step reports an error,
        ValueError when the result does not match that plan (nothing is applied then).
        """
        entry = self._inflight.oldest()
        if entry is None:
            raise RuntimeError("process_result() called with no plan in flight")
        plan = entry.plan
        sampled = check_result(plan, result)

        now = self.clock()
        applied = apply_result(
            entry,
            result,
            sampled,
            now,
            self.blocks,
            self._calibration_seq_ids,
            lambda req, reason: self._finish(req, reason, remove_from_running=False),
            optimistic=self.async_scheduling,
        )
        deltas, self._pending_deltas = self._pending_deltas + applied.deltas, []
        if applied.finished_any:
            self.running[:] = [r for r in self.running if not r.is_finished]
        if self.role == "prefill":
            self._park_first_tokens(entry.plan)

        self._inflight.pop()
        self._num_iterations += 1
        # two plans in flight: the worker started this one once it answered the previous
        start = max(entry.start, self._last_result_time) if self.async_scheduling else entry.start
        self._last_result_time = now
        record = entry.record(result, start, now)
        self.iteration_records.append(record)
        self._pipeline.result_in(record, now, idle=not self._inflight)
        if self.budget is not None:
            self.budget.observe_iteration(entry.shape, start, now, calibrated=not self.calibrating)
        return deltas

    # ---- internals ----

    def _start_calibration(self) -> None:
        """Queues the adaptive budget's calibration requests (see `adaptive`)."""
        per_request = min(self.max_model_len, self.blocks.num_token_slots // CALIBRATION_REQUESTS)
        requests = calibration_requests(self.config.chunk_size, per_request)
        for request_id, prompt, params in requests:
            self.add_request(request_id, prompt, params)
            self._calibration_seq_ids.add(self._next_seq_id - 1)
        if not requests and self.budget is not None:
            self.budget.calibrating = False

    def _note_preempted(self, decision: BatchDecision) -> None:
        for req in decision.preempted:
            self._num_preemptions += 1
            if req.on_worker:
                self._pending_freed.append(req.seq_id)
                req.on_worker = False

    def _finish(self, req: Request, reason: FinishReason, remove_from_running: bool = True) -> None:
        hold_blocks = False
        if req.status is RequestStatus.RUNNING:
            if remove_from_running:
                self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.PARKED:
            self.parking.pop(req.request_id)
        elif req.status is RequestStatus.TRANSFERRING:
            # a pull in progress writes into its blocks: they go when its ranks report
            hold_blocks = bool(self.pulls.cancel(req.request_id))
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not hold_blocks:
            self.blocks.free(req)
        if req.on_worker:
            self._pending_freed.append(req.seq_id)
            req.on_worker = False
        del self._requests[req.request_id]
        if self._calibration_seq_ids and req.seq_id in self._calibration_seq_ids:
            self._calibration_seq_ids.discard(req.seq_id)
            return
        self._num_finished += 1
