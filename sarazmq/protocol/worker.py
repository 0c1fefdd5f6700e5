"""Scheduler <-> workers: one `BatchPlan` per iteration to every worker, a `StepResult` back.

A `BatchPlan` is a diff: a request's prompt, sampling parameters and seed travel once
(in `NewSeq`) when it is first scheduled (or re-scheduled after a recompute
preemption); after that each iteration carries only which tokens to compute, the
new block ids, and the token sampled in the previous iteration.

All structs are `array_like` (compact msgpack arrays) and `omit_defaults`.
"""

from __future__ import annotations

import msgspec

from sarazmq.protocol.common import TokenLogprobs
from sarazmq.sampling_params import SamplingParams


class NewSeq(msgspec.Struct, array_like=True, omit_defaults=True):
    """A sequence the workers have not seen (or must rebuild after preemption).

    token_ids: every token known so far (prompt, plus outputs when recomputing).
    num_prompt_tokens: how many of token_ids are the original prompt (penalties and
        logprobs treat prompt and output differently).
    seed: sampling seed; with the output index it fixes the random draw of every step.
    num_cached_tokens: positions [0, num_cached_tokens) are computed already: their KV
        sits in the prefix-cache blocks at the head of the block table the first
        `ScheduledSeq.new_block_ids` bring (a multiple of the block size, < len(token_ids)),
        or, for a prompt computed by a disaggregated deployment's prefill instance, in the
        blocks its KV was sent into (the whole prompt); the first computed position is
        num_cached_tokens.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    num_cached_tokens: int = 0


class ScheduledSeq(msgspec.Struct, array_like=True, omit_defaults=True):
    """Compute positions [start_pos, start_pos + num_tokens) of one sequence this step.

    append_token_ids: tokens the worker does not know yet (the one sampled last step),
        appended to its history before computing.
    new_block_ids: KV blocks appended to the sequence's block table.
    sample: whether the last computed position yields a new token (end of prefill or
        decode); a mid-prompt chunk does not sample.
    """

    seq_id: int
    start_pos: int
    num_tokens: int
    append_token_ids: list[int] = []
    new_block_ids: list[int] = []
    sample: bool = True


class BatchPlan(msgspec.Struct, array_like=True, omit_defaults=True, tag="plan"):
    """One iteration's hybrid batch: what every worker runs this step."""

    step: int
    new_seqs: list[NewSeq] = []
    scheduled: list[ScheduledSeq] = []
    # sequences the workers must forget (finished, aborted or preempted)
    freed_seq_ids: list[int] = []


class StepResult(msgspec.Struct, array_like=True, omit_defaults=True, tag="result"):
    """What the driver (tp rank 0 of the last pipeline stage) sends back: one sampled
    token per scheduled sequence with sample=True.

    forward_s: the driver's own time on the plan (plan applied, forward, sampling).
    stage_busy_s / stage_wait_s: with pipeline parallelism, per stage (0 first), seconds
    its driver computed this plan / waited for the previous stage's activations after it
    had the plan (0 for stage 0); empty without pipeline parallelism.
    """

    step: int
    seq_ids: list[int] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    forward_s: float = 0.0
    error: str = ""
    stage_busy_s: list[float] = []
    stage_wait_s: list[float] = []


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    """Tells a worker to exit its loop."""

    reason: str = ""


class KVExport(msgspec.Struct, array_like=True, tag="kv_export"):
    """A prefill instance's scheduler -> its workers: the KV of `request_id` waits in
    `block_ids` for a decode instance to read (`sarazmq.worker.kv_transfer`)."""

    request_id: str
    block_ids: list[int]


class KVRelease(msgspec.Struct, array_like=True, tag="kv_release"):
    """A prefill instance's scheduler -> its workers: `request_id`'s KV may no longer be
    read (its blocks are freed)."""

    request_id: str


class KVPull(msgspec.Struct, array_like=True, tag="kv_pull"):
    """A decode instance's scheduler -> its workers: read the KV exported as
    `source_request_id` (its blocks `source_block_ids`) by instance `source_instance` (each
    rank from the same rank there) into this instance's `block_ids`, then report
    `KVPulled`."""

    seq_id: int
    source_instance: int
    source_request_id: str
    source_block_ids: list[int]
    block_ids: list[int]


class KVPulled(msgspec.Struct, array_like=True, omit_defaults=True, tag="kv_pulled"):
    """A decode instance's worker -> its scheduler: rank `rank` has `seq_id`'s KV in
    place (error "": it has; else why not), `nbytes` received in `seconds`."""

    seq_id: int
    rank: int
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


WorkerInbound = BatchPlan | Shutdown | KVExport | KVRelease | KVPull
#: what the scheduler reads from its workers: the driver's results, every rank's pulls
WorkerOutbound = StepResult | KVPulled
