"""Applying a step's result to the requests it scheduled (`apply_result`), and the
per-request delta that carries what a request gained to its detokenizer.

`apply_result` runs once per iteration over every scheduled request (256 running in
`scripts/bench_ipc.py`, whose per-iteration goal is under 1 ms with planning and IPC),
so its loop binds its lookups once and inlines the cheap checks of the common decode
(no finish, no newly full block) instead of calling out for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sarazmq.protocol.common import (
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    MaybeFinishReason,
    TokenLogprobs,
)
from sarazmq.protocol.engine import RequestDelta
from sarazmq.protocol.worker import StepResult
from sarazmq.scheduler.block_manager import BlockManager
from sarazmq.scheduler.inflight import InflightPlan
from sarazmq.scheduler.request import Request, RequestStatus


def finish_token_ids(
    stop_token_ids: list[int], ignore_eos: bool, eos_token_ids: frozenset[int]
) -> frozenset[int]:
    """Every token id whose sampling finishes a request with "stop" (past min_tokens):
    its stop ids, and the model's EOS ids unless it ignores EOS."""
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else eos_token_ids)


def request_delta(
    req: Request,
    tokens: list[int],
    times: list[float],
    logprobs: list[TokenLogprobs | None],
) -> RequestDelta:
    """The delta of `req` carrying `tokens` (sampled at `times`) and its finish state."""
    # positional (the struct's field order): one per request per iteration
    return RequestDelta(
        req.request_id,
        tokens,
        req.finish_reason,
        len(req.prompt_token_ids),
        req.arrival_time,
        req.first_scheduled_time,
        times,
        req.num_preemptions,
        logprobs,
    )


@dataclass
class AppliedResult:
    """What `apply_result` did: one delta per listened-to request that got a token or
    finished; finished_any: whether a request finished (the caller prunes its running
    list)."""

    deltas: list[RequestDelta]
    finished_any: bool


def apply_result(
    entry: InflightPlan,
    result: StepResult,
    sampled: dict[int, int],
    now: float,
    blocks: BlockManager,
    silent_seq_ids: set[int],
    finish: Callable[[Request, FinishReason], None],
    optimistic: bool = False,
) -> AppliedResult:
    """Applies `result` (already checked against `entry`'s plan; `sampled` maps a
    sampling seq_id to its index in the result) to the scheduled requests: advances
    their computed tokens, keys newly full blocks for the prefix cache, appends the
    sampled tokens, and calls `finish` (which must not touch the running list) for
    each request that finishes. Requests already finished while the step ran are
    skipped; those in `silent_seq_ids` (internal calibration requests) get no delta.

    optimistic: the plan was built by asynchronous scheduling (`inflight.build_plan`),
    which advanced the computed positions already; its sampled tokens were pending, and
    the worker that sampled them knows them (they count as sent while it holds the seq).
    """
    deltas: list[RequestDelta] = []
    finished_any = False
    reqs, token_ids, result_logprobs = entry.reqs, result.token_ids, result.logprobs
    finished = RequestStatus.FINISHED
    block_size = blocks.block_size
    # BlockManager.cache_full_blocks's own first test, made here: it does nothing
    # unless caching is on and a block filled past those keyed
    caching, cache_full_blocks = blocks.enable_caching, blocks.cache_full_blocks
    for s in entry.plan.scheduled:
        req = reqs[s.seq_id]
        if req.status is finished:
            continue  # aborted / stopped while the step ran
        if not optimistic:
            req.num_computed_tokens += s.num_tokens
        if not s.sample:
            if caching and req.num_computed_tokens // block_size > req.num_keyed_blocks:
                cache_full_blocks(req)  # its KV is written now: reusable
            continue
        i = sampled[s.seq_id]
        token = token_ids[i]
        outputs = req.output_token_ids
        outputs.append(token)
        if optimistic:
            req.num_pending_samples -= 1
            if req.on_worker:
                req.num_sent_tokens += 1
        # after the append: an optimistic request's scheduled positions may reach it
        if caching and req.num_computed_tokens // block_size > req.num_keyed_blocks:
            cache_full_blocks(req)
        req.token_times.append(now)
        n_out = len(outputs)
        # "stop" on a finishing token once min_tokens outputs exist, else "length" at
        # the output limit
        if token in req.finish_token_ids and n_out >= req.params.min_tokens:
            reason: MaybeFinishReason = FINISH_STOP
        elif n_out >= req.max_output_tokens:
            reason = FINISH_LENGTH
        else:
            reason = ""
        # asked before `finish`, which forgets a finished calibration request
        silent = bool(silent_seq_ids) and s.seq_id in silent_seq_ids
        if reason:
            finish(req, reason)
            finished_any = True
        if silent:
            continue
        lps: list[TokenLogprobs | None] = [result_logprobs[i]] if result_logprobs else []
        deltas.append(request_delta(req, [token], [now], lps))
    return AppliedResult(deltas, finished_any)
