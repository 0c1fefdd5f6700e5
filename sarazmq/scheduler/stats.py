"""What the scheduler reports: point-in-time counters and one record per iteration."""

from __future__ import annotations

import msgspec

MAX_ITERATION_RECORDS = 200_000


class IterationRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One completed iteration (appended by process_result).

    start: scheduler clock when the plan was built; end: when its result was processed.
    forward_s: the worker's own forward time from the StepResult.
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


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Point-in-time counters."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_iterations: int
    num_preemptions: int
    num_finished: int = 0
