"""Plans in flight: up to `max_inflight` of them (one per pipeline stage), results FIFO.

With pipeline parallelism over `pp` stages the scheduler keeps up to `pp` micro-batches
in flight, so every stage has work. A request is in at most one of them: its next step
depends on the token the in-flight one samples (or on the KV a prefill chunk writes).
The policies therefore never see a request in flight (`PolicyView`): they cannot
schedule it again nor preempt it (its blocks are being written), while the sequence
limit and the admission watermark still count it. With more than one plan allowed in
flight, a micro-batch also takes at most its share (1/max_inflight) of the running
requests, so the micro-batches stay balanced (a pipeline's throughput is its slowest
stage's, and an empty micro-batch leaves stages idle).

Workers apply plans in the order they were sent, so the plan diff stays consistent
however many are in flight; results come back in the same order.

Asynchronous scheduling (`EngineConfig.async_scheduling`, vLLM V1's, one pipeline stage)
keeps two plans in flight so the scheduler builds plan N+1 while the worker runs plan N.
There a request may be in both: plan N+1 goes on from where plan N leaves it, as if N's
result were in (`build_plan(..., optimistic=True)` advances its computed positions and
counts the token N samples as pending), and the worker feeds a decode the token it
sampled itself in N (`ModelRunner(keep_sampled_tokens=True)`), which the scheduler learns
with N's result. A request that finishes in N has run one step more in N+1 whose result
is dropped, as in vLLM; one whose pending token is its last (its length) is not
scheduled again (`async_hidden_seq_ids`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq, StepResult
from sarazmq.scheduler.policies import BatchDecision
from sarazmq.scheduler.prefix_cache import PrefixCacheCounters
from sarazmq.scheduler.request import Request
from sarazmq.scheduler.shape import IterationShape, shape_of_plan
from sarazmq.scheduler.stats import IterationRecord


@dataclass
class InflightPlan:
    """A plan sent to the workers whose result has not been processed yet.

    reqs: the scheduled requests by seq_id; start: scheduler clock when it was built;
    num_preempted: preemptions while building it; cache: its admissions' prefix-cache
    counters; shape: its `IterationShape`; token_budget: the policy's (`BatchDecision`).
    """

    plan: BatchPlan
    reqs: dict[int, Request]
    start: float
    num_preempted: int
    cache: PrefixCacheCounters
    shape: IterationShape
    token_budget: int = 0
    # (prefill tokens, decode tokens, prefill seqs, decode seqs)
    token_counts: tuple[int, int, int, int] = (0, 0, 0, 0)

    def record(self, result: StepResult, start: float, end: float) -> IterationRecord:
        """The IterationRecord of this plan answered by `result` at `end`, run from
        `start` (its build, or with two plans in flight the previous result)."""
        prefill_tokens, decode_tokens, prefill_seqs, decode_seqs = self.token_counts
        return IterationRecord(
            step=self.plan.step,
            start=start,
            end=end,
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
            num_seqs=len(self.plan.scheduled),
            num_prefill_seqs=prefill_seqs,
            num_decode_seqs=decode_seqs,
            num_preempted=self.num_preempted,
            forward_s=result.forward_s,
            cache_queries=self.cache.queries,
            cache_hits=self.cache.hits,
            preempted_cache_queries=self.cache.preempted_queries,
            preempted_cache_hits=self.cache.preempted_hits,
            prefill_attention_pairs=self.shape.prefill_attention_pairs,
            decode_context_tokens=self.shape.decode_context_tokens,
            num_sampled=self.shape.num_sampled,
            stage_busy_s=list(result.stage_busy_s) or [result.forward_s],
            stage_wait_s=list(result.stage_wait_s),
            token_budget=self.token_budget,
        )


@dataclass
class InflightQueue:
    """The plans in flight, oldest first, and the seq ids they hold."""

    max_inflight: int
    plans: deque[InflightPlan] = field(default_factory=deque)
    seq_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight={self.max_inflight} must be >= 1")

    def __len__(self) -> int:
        return len(self.plans)

    def __iter__(self) -> Iterator[InflightPlan]:
        return iter(self.plans)

    @property
    def full(self) -> bool:
        return len(self.plans) >= self.max_inflight

    def push(self, entry: InflightPlan) -> None:
        if self.full:
            raise RuntimeError(
                f"{len(self.plans)} plans in flight already (max_inflight={self.max_inflight})"
            )
        self.plans.append(entry)
        self.seq_ids.update(entry.reqs)

    def oldest(self) -> InflightPlan | None:
        return self.plans[0] if self.plans else None

    def pop(self) -> InflightPlan:
        entry = self.plans.popleft()
        # a request can be in two plans (asynchronous scheduling): keep the ids the
        # remaining plans still hold
        still_held = {sid for plan in self.plans for sid in plan.reqs}
        self.seq_ids.difference_update(sid for sid in entry.reqs if sid not in still_held)
        return entry


class PolicyView:
    """The running list a policy may touch while plans are in flight.

    `running` holds the running requests the next micro-batch may take: not in flight,
    and at most `share` of them (the oldest), so that pp micro-batches split the running
    requests evenly instead of the first taking them all and leaving the other stages
    idle. The policy mutates it (preemptions remove, admissions append); `merge()`
    writes the outcome back into the scheduler's full running list, the hidden requests
    in place. `num_hidden` counts the running requests the policy does not see (they
    still hold blocks and count against max_num_seqs).
    """

    def __init__(self, running: list[Request], inflight_seq_ids: set[int], share: int) -> None:
        self._all = running
        free = [r for r in running if r.seq_id not in inflight_seq_ids]
        self.running = free[: max(share, 0)]
        self._visible_order = list(self.running)
        self._visible = {id(r) for r in self.running}
        self.num_hidden = len(running) - len(self.running)

    def merge(self) -> None:
        # policies only remove (preempt) and append (admit): `running` is the visible
        # requests that stayed, in their order, then the appended ones (a request
        # preempted and re-admitted in one schedule() among them, at the end as it
        # would be without the view)
        stayed: set[int] = set()
        order = iter(self._visible_order)
        tail = len(self.running)
        for i, req in enumerate(self.running):
            if not any(r is req for r in order):
                tail = i
                break
            stayed.add(id(req))
        merged = [r for r in self._all if id(r) not in self._visible or id(r) in stayed]
        merged.extend(self.running[tail:])
        self._all[:] = merged


def async_hidden_seq_ids(running: list[Request]) -> set[int]:
    """Asynchronous scheduling: the running requests not to schedule now, those whose
    pending tokens (sampled by the plan in flight) reach their output limit: that plan's
    result finishes them."""
    return {
        r.seq_id
        for r in running
        if r.num_pending_samples
        and r.num_output_tokens + r.num_pending_samples >= r.max_output_tokens
    }


def build_plan(
    decision: BatchDecision,
    step: int,
    freed_seq_ids: list[int],
    start: float,
    num_preempted: int,
    prefix_cache: PrefixCacheCounters,
    optimistic: bool = False,
) -> InflightPlan:
    """Turns a policy's decision into the wire plan (the diff, see `Scheduler`) and its
    in-flight entry; updates the requests' sent-token counts and `prefix_cache`.

    optimistic (asynchronous scheduling): the scheduled requests are advanced now, as if
    the plan's result were in: computed positions, and a pending sample for each entry
    that samples (its token the worker keeps; `apply_result` appends it here)."""
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
                # positions whose KV is there: prefix-cache hits, or a prompt sent by
                # a prefill instance
                num_cached_tokens=max(req.num_cached_tokens, req.num_transferred_tokens),
            )
        )
        preempted = req.num_preemptions > 0
        prefix_cache.record(req.num_prefill_tokens, req.num_cached_tokens, preempted)
        cache_step.record(req.num_prefill_tokens, req.num_cached_tokens, preempted)
        req.num_sent_tokens = len(tokens)
        req.on_worker = True

    scheduled: list[ScheduledSeq] = []
    reqs: dict[int, Request] = {}
    new_blocks = decision.new_blocks
    work = [(r, 1) for r in decision.decodes] + decision.prefills
    # once per scheduled request per iteration (bench_ipc.py: 256 running): the seq built
    # positionally, in the struct's field order, which is several times cheaper
    for req, n in work:
        start_pos = req.num_computed_tokens
        append = req.tokens_from(req.num_sent_tokens)
        num_tokens = req.num_sent_tokens = req.num_tokens
        seq_id = req.seq_id
        # the positions to sample at: every known token, and those plans in flight sample
        sample = start_pos + n == num_tokens + req.num_pending_samples
        scheduled.append(
            ScheduledSeq(seq_id, start_pos, n, append, new_blocks.get(seq_id, []), sample)
        )
        reqs[seq_id] = req
        if optimistic:
            req.num_computed_tokens = start_pos + n
            if sample:
                req.num_pending_samples += 1

    plan = BatchPlan(step=step, new_seqs=new_seqs, scheduled=scheduled, freed_seq_ids=freed_seq_ids)
    num_decodes = len(decision.decodes)
    shape = shape_of_plan(plan, num_decodes)
    prefill_tokens = shape.num_prefill_tokens
    counts = (prefill_tokens, num_decodes, len(decision.prefills), num_decodes)
    return InflightPlan(
        plan, reqs, start, num_preempted, cache_step, shape, decision.token_budget, counts
    )
