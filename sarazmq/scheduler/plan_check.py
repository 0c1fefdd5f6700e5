"""Checking a worker's `StepResult` against the plan it answers, before applying anything."""

from __future__ import annotations

from sarazmq.protocol.worker import BatchPlan, StepResult


def check_result(plan: BatchPlan, result: StepResult) -> dict[int, int]:
    """seq_id -> index into the result's tokens, for the sampled seqs of `plan`.

    RuntimeError when the step reports an error; ValueError when the result does not
    match the plan (another step, missing or extra tokens, mismatched lengths)."""
    if result.step != plan.step:
        raise ValueError(f"result is for step {result.step}, plan in flight is {plan.step}")
    if result.error:
        raise RuntimeError(f"workers failed step {plan.step}: {result.error}")
    if len(result.seq_ids) != len(result.token_ids):
        raise ValueError(
            f"result has {len(result.seq_ids)} seq_ids but {len(result.token_ids)} token_ids"
        )
    if result.logprobs and len(result.logprobs) != len(result.seq_ids):
        raise ValueError(
            f"result has {len(result.logprobs)} logprobs for {len(result.seq_ids)} tokens"
        )
    sampled = {sid: i for i, sid in enumerate(result.seq_ids)}
    expected = {s.seq_id for s in plan.scheduled if s.sample}
    if len(sampled) != len(result.seq_ids) or sampled.keys() != expected:
        raise ValueError(
            f"step {plan.step}: result tokens for seqs {sorted(result.seq_ids)}, "
            f"plan samples seqs {sorted(expected)}"
        )
    return sampled
