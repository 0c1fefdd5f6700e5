"""What the scheduler reports: point-in-time counters and one record per iteration."""

from __future__ import annotations

import msgspec

from sarazmq.perf.shape import IterationShape, shape_of_fields

MAX_ITERATION_RECORDS = 200_000


class IterationRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One completed iteration (appended by process_result).

    start: scheduler clock when the plan was built; end: when its result was processed.
    forward_s: the worker's own forward time from the StepResult.
    cache_queries / cache_hits: prompt tokens of the requests first admitted in this
    iteration / how many of them the prefix cache held; preempted_cache_*: the same for
    re-admissions after a preemption. prefill_attention_pairs / decode_context_tokens /
    num_sampled: the rest of its `IterationShape`.
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

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hits / queries over first admissions (0 when there were none)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
