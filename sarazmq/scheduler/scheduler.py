"""The scheduler: request bookkeeping, batch policy, and the plan diff for the workers.

Pure and socket-free: the engine feeds it requests and step results and ships its
plans. Protocol, exactly one plan in flight:

    plan = scheduler.schedule()          # None when there is nothing to run
    ... workers run plan, rank 0 answers a StepResult ...
    deltas = scheduler.process_result(result)

Worker contract for a `BatchPlan` (the diff): first forget every seq in
`freed_seq_ids`, then create every `new_seqs` entry (token_ids = all tokens known,
empty block table, its first `num_cached_tokens` positions computed: their KV is in
the shared prefix-cache blocks that lead its first `new_block_ids`), then for each
`scheduled` entry append
`append_token_ids` to the seq's tokens and `new_block_ids` to its block table and
compute positions [start_pos, start_pos + num_tokens); if `sample`, the last one
yields the seq's next token. `scheduled` lists decodes first, then prefill chunks
(the attention metadata layout).

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
from sarazmq.perf.shape import IterationShape, shape_of_plan
from sarazmq.protocol.common import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    MaybeFinishReason,
    TokenLogprobs,
)
from sarazmq.protocol.engine import RequestDelta
from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq, StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.adaptive import (
    CALIBRATION_REQUESTS,
    build_adaptive_budget,
    calibration_requests,
)
from sarazmq.scheduler.block_manager import BlockManager
from sarazmq.scheduler.plan_check import check_result
from sarazmq.scheduler.policies import BatchDecision, ScheduleContext, make_policy
from sarazmq.scheduler.prefix_cache import BlockHashFn, PrefixCacheCounters, sha256_block_key
from sarazmq.scheduler.request import Request, RequestStatus
from sarazmq.scheduler.stats import MAX_ITERATION_RECORDS, IterationRecord, SchedulerStats
from sarazmq.validation import InvalidRequestError, check_prompt_token_ids


class Scheduler:
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
    ) -> None:
        """seed: if given, the per-request seeds drawn for requests without
        params.seed come from a generator seeded with it (reproducible runs);
        otherwise from OS entropy.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (see
        `BlockManager`); off here by default, on by default in `CacheConfig`.
        block_hash_fn: the prefix cache's block key (tests pass a colliding stub)."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.blocks = BlockManager(
            block_size, num_blocks, enable_caching=enable_prefix_caching, hash_fn=block_hash_fn
        )
        self.prefix_cache = PrefixCacheCounters()
        self.policy = make_policy(config, max_model_len)
        self._rng = random.Random(seed)
        self._watermark_blocks = int(config.watermark * num_blocks)

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # live (not finished) requests
        self._next_seq_id = 0
        self._step = 0
        self._inflight: BatchPlan | None = None
        self._inflight_reqs: dict[int, Request] = {}
        self._inflight_start = 0.0
        self._inflight_preempted = 0
        self._inflight_cache = PrefixCacheCounters()
        self._inflight_shape = IterationShape()
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
        self._pending_deltas.append(self._delta(req, [], [], []))
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
    def inflight(self) -> bool:
        return self._inflight is not None

    @property
    def calibrating(self) -> bool:
        """True while the adaptive budget's calibration requests run (they go first)."""
        return bool(self._calibration_seq_ids)

    @property
    def inflight_shape(self) -> IterationShape:
        """The shape of the plan in flight (of the last plan once its result is in)."""
        return self._inflight_shape

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
            **(self.budget.stats_fields() if self.budget is not None else {}),
        )

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Forgets every cached block key. Refused, (False, why), while any request
        holds KV blocks (running, or a plan in flight): reset an idle engine."""
        if self._inflight is not None:
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
        """Builds the next plan, or None when there is nothing to run. Raises
        RuntimeError if the previous plan's result was not processed yet."""
        if self._inflight is not None:
            raise RuntimeError(
                f"schedule() called while plan {self._inflight.step} is in flight; "
                "call process_result() first"
            )
        start = self.clock()
        ctx = ScheduleContext(
            waiting=self.waiting,
            running=self.running,
            blocks=self.blocks,
            max_num_seqs=self.config.max_num_seqs,
            watermark_blocks=self._watermark_blocks,
            prefill_budget=self.budget.prefill_budget if self.budget is not None else None,
        )
        decision = self.policy.schedule(ctx)
        num_preempted = len(decision.preempted)
        self._note_preempted(decision)
        if decision.empty and decision.preempted:
            # preemption emptied the batch; with the victims back in waiting, a fresh
            # pass can admit (policies do not admit in a step that preempted)
            decision = self.policy.schedule(ctx)
            num_preempted += len(decision.preempted)
            self._note_preempted(decision)
        if decision.empty:
            return None

        new_seqs: list[NewSeq] = []
        cache_step = PrefixCacheCounters()  # this iteration's admissions
        for req in decision.admitted:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
            tokens = req.all_token_ids
            new_seqs.append(
                NewSeq(
                    seq_id=req.seq_id,
                    token_ids=tokens,
                    num_prompt_tokens=req.num_prompt_tokens,
                    params=req.params,
                    seed=req.seed,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            self.prefix_cache.record(
                req.num_prefill_tokens, req.num_cached_tokens, req.num_preemptions > 0
            )
            cache_step.record(
                req.num_prefill_tokens, req.num_cached_tokens, req.num_preemptions > 0
            )
            req.num_sent_tokens = len(tokens)
            req.on_worker = True

        scheduled: list[ScheduledSeq] = []
        inflight_reqs: dict[int, Request] = {}
        work = [(r, 1) for r in decision.decodes] + decision.prefills
        for req, n in work:
            start_pos = req.num_computed_tokens
            append = req.tokens_from(req.num_sent_tokens)
            req.num_sent_tokens = req.num_tokens
            scheduled.append(
                ScheduledSeq(
                    seq_id=req.seq_id,
                    start_pos=start_pos,
                    num_tokens=n,
                    append_token_ids=append,
                    new_block_ids=decision.new_blocks.get(req.seq_id, []),
                    sample=start_pos + n == req.num_tokens,
                )
            )
            inflight_reqs[req.seq_id] = req

        self._step += 1
        plan = BatchPlan(
            step=self._step,
            new_seqs=new_seqs,
            scheduled=scheduled,
            freed_seq_ids=self._pending_freed,
        )
        self._pending_freed = []
        self._inflight = plan
        self._inflight_reqs = inflight_reqs
        self._inflight_start = start
        self._inflight_preempted = num_preempted
        self._inflight_cache = cache_step
        self._inflight_shape = shape_of_plan(plan, len(decision.decodes))
        return plan

    def process_result(self, result: StepResult) -> list[RequestDelta]:
        """Applies the in-flight plan's result: advances computed tokens, appends the
        sampled tokens, finishes requests. Returns one delta per request that got a
        token or finished (pending abort deltas first).

        Raises RuntimeError when no plan is in flight or the step reports an error,
        ValueError when the result does not match the plan (nothing is applied then).
        """
        plan = self._inflight
        if plan is None:
            raise RuntimeError("process_result() called with no plan in flight")
        sampled = check_result(plan, result)

        now = self.clock()
        deltas = self._pending_deltas
        self._pending_deltas = []
        num_prefill_tokens = num_decode_tokens = num_prefill_seqs = num_decode_seqs = 0
        finished_any = False
        for s in plan.scheduled:
            req = self._inflight_reqs[s.seq_id]
            was_prefill = req.is_prefill
            if was_prefill:
                num_prefill_tokens += s.num_tokens
                num_prefill_seqs += 1
            else:
                num_decode_tokens += s.num_tokens
                num_decode_seqs += 1
            if req.is_finished:
                continue  # aborted / stopped while the step ran
            req.num_computed_tokens += s.num_tokens
            self.blocks.cache_full_blocks(req)  # its KV is written now: reusable
            if not s.sample:
                continue
            i = sampled[s.seq_id]
            token = result.token_ids[i]
            req.output_token_ids.append(token)
            req.token_times.append(now)
            internal = s.seq_id in self._calibration_seq_ids  # nobody is listening
            reason = self._check_finish(req, token)
            if reason:
                self._finish(req, reason, remove_from_running=False)
                finished_any = True
            if internal:
                continue
            lps: list[TokenLogprobs | None] = [result.logprobs[i]] if result.logprobs else []
            deltas.append(self._delta(req, [token], [now], lps))
        if finished_any:
            self.running[:] = [r for r in self.running if not r.is_finished]

        self._num_iterations += 1
        self.iteration_records.append(
            IterationRecord(
                step=plan.step,
                start=self._inflight_start,
                end=now,
                num_prefill_tokens=num_prefill_tokens,
                num_decode_tokens=num_decode_tokens,
                num_seqs=len(plan.scheduled),
                num_prefill_seqs=num_prefill_seqs,
                num_decode_seqs=num_decode_seqs,
                num_preempted=self._inflight_preempted,
                forward_s=result.forward_s,
                cache_queries=self._inflight_cache.queries,
                cache_hits=self._inflight_cache.hits,
                preempted_cache_queries=self._inflight_cache.preempted_queries,
                preempted_cache_hits=self._inflight_cache.preempted_hits,
                prefill_attention_pairs=self._inflight_shape.prefill_attention_pairs,
                decode_context_tokens=self._inflight_shape.decode_context_tokens,
                num_sampled=self._inflight_shape.num_sampled,
            )
        )
        if self.budget is not None:
            self.budget.observe_iteration(
                self._inflight_shape, self._inflight_start, now, calibrated=not self.calibrating
            )
        self._inflight = None
        self._inflight_reqs = {}
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

    def _check_finish(self, req: Request, token: int) -> MaybeFinishReason:
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return FINISH_STOP
            if token in p.stop_token_ids:
                return FINISH_STOP
        if n_out >= req.max_output_tokens:
            return FINISH_LENGTH
        return ""

    def _finish(self, req: Request, reason: FinishReason, remove_from_running: bool = True) -> None:
        if req.status is RequestStatus.RUNNING:
            if remove_from_running:
                self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.blocks.free(req)
        if req.on_worker:
            self._pending_freed.append(req.seq_id)
            req.on_worker = False
        del self._requests[req.request_id]
        if self._calibration_seq_ids and req.seq_id in self._calibration_seq_ids:
            self._calibration_seq_ids.discard(req.seq_id)
            return
        self._num_finished += 1

    def _delta(
        self,
        req: Request,
        tokens: list[int],
        times: list[float],
        logprobs: list[TokenLogprobs | None],
    ) -> RequestDelta:
        return RequestDelta(
            request_id=req.request_id,
            new_token_ids=tokens,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            token_times=times,
            num_preemptions=req.num_preemptions,
            logprobs=logprobs,
        )
