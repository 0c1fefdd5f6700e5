"""What the scheduler reports: point-in-time counters and one record per iteration."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from sarazmq.scheduler.shape import IterationShape, shape_of_fields

MAX_ITERATION_RECORDS = 200_000


class IterationRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One completed iteration (appended by process_result).

    start: scheduler clock when the plan was built, or under asynchronous scheduling when
    the previous plan's result was processed if that is later (the worker was busy with it
    until then); end: when its result was processed.
    forward_s: the worker's own forward time from the StepResult.
    cache_queries / cache_hits: prompt tokens of the requests first admitted in this
    iteration / how many of them the prefix cache held; preempted_cache_*: the same for
    re-admissions after a preemption. prefill_attention_pairs / decode_context_tokens /
    num_sampled: the rest of its `IterationShape`.
    stage_busy_s / stage_wait_s: per pipeline stage, seconds it computed this plan / waited
    for its incoming activations (`StepResult`); one stage without pipeline parallelism.
    token_budget: the tokens the policy let the iteration hold (`BatchDecision`; under
    --tbt-slo the adaptive budget's choice); 0 when no token budget bounded it.
    """

    step: int
    start: float
    end: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_preempted: int = 0
    forward_s: float = 0.0
    cache_queries: int = 0
    cache_hits: int = 0
    preempted_cache_queries: int = 0
    preempted_cache_hits: int = 0
    prefill_attention_pairs: int = 0
    decode_context_tokens: int = 0
    num_sampled: int = 0
    stage_busy_s: list[float] = []
    stage_wait_s: list[float] = []
    token_budget: int = 0

    def shape(self) -> IterationShape:
        """The iteration's shape (what the latency model predicts from)."""
        return shape_of_fields(self)


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Point-in-time counters.

    Prefix cache (tokens, cumulative; see `prefix_cache.PrefixCacheCounters`):
    prefix_cache_queries / _hits at first admissions, prefix_cache_preempted_* at
    re-admissions after a recompute preemption. num_cached_blocks: blocks holding a key
    now; num_evictions: cached blocks handed out for new contents so far.

    Adaptive budget (tbt_slo > 0, see `adaptive`): calibrating while its startup requests
    run; latency_model_*: out-of-sample error of the iteration-time model over recent
    iterations (fractions of the measured time) and its safety margin; budget_*: mean
    prefill chunk with decodes running, iterations the slack cut below chunk_size, and
    iterations with no slack left (the minimum chunk ran).

    Disaggregated deployment (`transfers`): kv_pulls / kv_pull_bytes / kv_pull_seconds:
    the prompts' KV a decode instance pulled so far (bytes of every rank; seconds of the
    slowest rank per pull); num_parked: a prefill instance's requests whose KV waits.

    Pipeline (see `bubble_fraction`): pipeline_parallel_size stages; active_s: seconds
    with at least one plan in flight; stage_busy_s: per stage, seconds computing, summed;
    bubble_fraction: idle stage time / total stage time over the active time.

    async_scheduling: plan N+1 is built while plan N runs (`inflight`);
    num_overlapped_plans: plans built while another was in flight (micro-batches of a
    pipeline count too).
    """

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_iterations: int
    num_preemptions: int
    num_finished: int = 0
    prefix_caching: bool = False
    num_cached_blocks: int = 0
    num_evictions: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_preempted_requests: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    tbt_slo: float = 0.0
    calibrating: bool = False
    latency_model_samples: int = 0
    latency_model_mape: float = 0.0
    latency_model_p95_error: float = 0.0
    latency_model_margin: float = 0.0
    budget_mean_chunk: float = 0.0
    budget_limited_iterations: int = 0
    budget_min_chunk_iterations: int = 0
    pipeline_parallel_size: int = 1
    kv_pulls: int = 0
    kv_pull_bytes: int = 0
    kv_pull_seconds: float = 0.0
    num_parked: int = 0
    active_s: float = 0.0
    stage_busy_s: list[float] = []
    bubble_fraction: float = 0.0
    async_scheduling: bool = False
    num_overlapped_plans: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hits / queries over first admissions (0 when there were none)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def active_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (time with a plan in flight)."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def bubble_fraction_of(busy_s: float, active_s: float, num_stages: int) -> float:
    """Idle stage time / total stage time: 1 - busy / (num_stages * active), in [0, 1]."""
    total = num_stages * active_s
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy_s / total))


def bubble_fraction(records: Sequence[IterationRecord], num_stages: int) -> float:
    """The pipeline bubble fraction over a window of iterations (the simulator's metric
    of the same name): every stage's total time is the active time (the union of the
    iterations' [start, end]); its idle time is that minus the seconds it computed
    (`stage_busy_s`). Returns summed idle / summed total over the stages, 0 for no
    iterations. ValueError for num_stages < 1."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    busy = sum(sum(r.stage_busy_s) if r.stage_busy_s else r.forward_s for r in records)
    return bubble_fraction_of(busy, active_seconds((r.start, r.end) for r in records), num_stages)


class PipelineAccounting:
    """The scheduler's running totals behind SchedulerStats' pipeline fields: active
    time (some plan in flight) and every stage's busy time."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.active_s = 0.0
        self.stage_busy_s = [0.0] * num_stages
        self._since = 0.0

    def plan_sent(self, start: float, was_idle: bool) -> None:
        if was_idle:
            self._since = start

    def result_in(self, record: IterationRecord, now: float, idle: bool) -> None:
        """A plan's result is in; `idle`: no plan is in flight any more."""
        for i, busy in enumerate(record.stage_busy_s[: self.num_stages]):
            self.stage_busy_s[i] += busy
        if idle:
            self.active_s += now - self._since

    def fields(self, now: float, busy_now: bool) -> dict[str, object]:
        """SchedulerStats' pipeline fields at `now` (`busy_now`: a plan is in flight)."""
        active = self.active_s + (now - self._since if busy_now else 0.0)
        busy = list(self.stage_busy_s)
        return {
            "pipeline_parallel_size": self.num_stages,
            "active_s": active,
            "stage_busy_s": busy,
            "bubble_fraction": bubble_fraction_of(sum(busy), active, self.num_stages),
        }
