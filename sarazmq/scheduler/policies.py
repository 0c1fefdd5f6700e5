"""Batching policies: Sarathi-Serve's stall-free hybrid batches and its baselines.

Each policy is one small class with one method, `schedule(ctx) -> BatchDecision`. It
decides which requests run this iteration and how many tokens each computes, and it
performs admissions (allocating a new request's whole prefill up front) and recompute
preemptions directly on `ctx` (waiting deque, running list, block manager). The
`Scheduler` turns the decision into a wire plan.

Shared rules:
- `ctx.running` is kept in admission order, so "newest" is `running[-1]`.
- A decode that cannot get a block preempts the newest running request (by
  recompute: blocks freed, computed tokens reset, outputs kept, put back at the
  FRONT of waiting), possibly itself, until it fits. Decodes never see the watermark.
- Admission is FCFS from the head of waiting (no skipping): the request's whole
  prefill (prompt, plus outputs after a preemption) must fit in free blocks while
  leaving the watermark (prefix-cache hits are shared, not allocated; a hit on a free
  cached block still takes it out of the free pool). Only the uncached tokens are
  computed and count against the token budget, and fewer than max_num_seqs may be
  running. The watermark is
  waived when nothing at all is running (every block is free then), so a request that
  fits the pool can always start.
- No admission in an iteration that preempted: the victims are at the head of
  waiting, and re-admitting one in the same plan that frees it would only thrash.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sarazmq.config import SchedulerConfig
from sarazmq.scheduler.block_manager import BlockManager
from sarazmq.scheduler.request import Request, RequestStatus


@dataclass
class ScheduleContext:
    """What a policy sees and mutates."""

    waiting: deque[Request]
    running: list[Request]
    blocks: BlockManager
    max_num_seqs: int
    watermark_blocks: int
    # (decodes scheduled, first prefill's computed length) -> prefill tokens this
    # iteration; set under a TBT target (`adaptive.AdaptiveBudget`), else chunk_size rules
    prefill_budget: Callable[[list[Request], int], int] | None = None
    # running requests left out of `running` (pipeline parallelism: in a plan in flight,
    # or another micro-batch's share): not to be scheduled or preempted now, but they hold
    # blocks, so the pool is not idle (`inflight.PolicyView`)
    num_hidden: int = 0


@dataclass
class BatchDecision:
    """One iteration's batch, as chosen by a policy.

    decodes: requests computing their one pending token (in running order).
    prefills: (request, num_tokens) prefill chunks, running ones first, then admitted.
    admitted: requests admitted this iteration (their first chunk is in `prefills`).
    preempted: requests preempted this iteration (already back in waiting).
    new_blocks: seq_id -> block ids allocated this iteration.
    token_budget: the tokens the policy let this iteration hold (decodes + the prefill
    tokens it could have scheduled); 0 when no token budget bounded it (Orca,
    FasterTransformer, decode-only iterations of vLLM and simple chunking).
    """

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_blocks: dict[int, list[int]] = field(default_factory=dict)
    token_budget: int = 0

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


def preempt(ctx: ScheduleContext, request: Request, out: BatchDecision) -> None:
    """Recompute preemption: frees the request's blocks and puts it back at the front
    of waiting; its outputs are kept, and its next prefill covers prompt + outputs."""
    ctx.running.remove(request)
    ctx.blocks.free(request)
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    request.num_transferred_tokens = 0  # its recompute covers the sent KV too
    request.num_prefill_tokens = 0
    request.num_sent_tokens = 0
    request.num_preemptions += 1
    ctx.waiting.appendleft(request)
    out.preempted.append(request)
    out.new_blocks.pop(request.seq_id, None)


class Policy(abc.ABC):
    """Chooses each iteration's batch. Stateless except where noted (simple_chunking)."""

    name: str = ""

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self.max_model_len = max_model_len

    @abc.abstractmethod
    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        """Builds this iteration's batch, admitting/preempting on `ctx` as needed."""

    # ---- building blocks shared by the policies ----

    def _schedule_decodes(self, ctx: ScheduleContext, out: BatchDecision) -> None:
        """Every running request in its decode phase gets its one token; a decode that
        needs a block and finds none preempts the newest running request (maybe
        itself) until it fits."""
        block_size = ctx.blocks.block_size
        i = 0
        while i < len(ctx.running):
            req = ctx.running[i]
            if req.is_prefill:
                i += 1
                continue
            upto = req.num_computed_tokens + 1
            if upto <= len(req.block_ids) * block_size:
                # its last block has room (block_size - 1 decodes in block_size): the
                # pool is not asked, which keeps 256 running decodes well under 1 ms
                out.decodes.append(req)
                i += 1
                continue
            preempted_self = False
            while not ctx.blocks.can_grow(req, upto):
                # running[-1] sits at index >= i, so it was not scheduled yet this step
                victim = ctx.running[-1]
                preempt(ctx, victim, out)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break  # req was the last running request
            new = ctx.blocks.allocate(req, upto)
            if new:
                out.new_blocks[req.seq_id] = new
            out.decodes.append(req)
            i += 1

    def _schedule_running_prefills(
        self, ctx: ScheduleContext, out: BatchDecision, budget: int
    ) -> int:
        """Continues chunked prefills of running requests, oldest first; returns the
        budget left. Their blocks were all allocated at admission."""
        for req in ctx.running:
            if budget <= 0:
                break
            if req.is_prefill:
                n = min(req.num_prefill_tokens - req.num_computed_tokens, budget)
                out.prefills.append((req, n))
                budget -= n
        return budget

    def _admit(
        self,
        ctx: ScheduleContext,
        out: BatchDecision,
        budget: int | None,
        whole: bool,
    ) -> int | None:
        """Admits requests FCFS from the head of waiting.

        budget: prefill tokens left this iteration (None = unlimited).
        whole: each admitted prefill runs in full (and must fit the budget whole);
            otherwise the last one admitted is cut to the budget (chunked prefill).
        Returns the budget left.
        """
        if out.preempted:
            return budget
        while ctx.waiting and len(ctx.running) < ctx.max_num_seqs:
            if budget is not None and budget <= 0:
                break
            req = ctx.waiting[0]
            if req.num_pending_samples:
                # preempted while a plan in flight samples its next token (asynchronous
                # scheduling): its recompute must wait for that token
                break
            total = req.num_tokens  # prompt (+ outputs after a preemption)
            # prefix cache: whole leading blocks already computed (at most total - 1); a
            # prompt whose KV was sent by another instance takes fresh blocks for it
            transferred = req.num_transferred_tokens
            # a pulled prompt's KV is already in the blocks it was given (`transfers`)
            preallocated = bool(transferred and req.block_ids)
            hits = ctx.blocks.find_cached_blocks(req) if not transferred else []
            cached = len(hits) * ctx.blocks.block_size
            computed = max(cached, transferred)
            to_compute = total - computed
            if whole and budget is not None and to_compute > budget:
                break
            watermark = ctx.watermark_blocks if ctx.running or ctx.num_hidden else 0
            if not preallocated and not ctx.blocks.can_allocate_with_hits(total, hits, watermark):
                break
            ctx.waiting.popleft()
            if not preallocated:
                ctx.blocks.allocate_with_hits(req, hits, total)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = computed
            req.num_cached_tokens = cached
            req.num_prefill_tokens = total
            ctx.running.append(req)
            out.admitted.append(req)
            if req.block_ids:
                # the worker learns the whole table, shared cached blocks included
                out.new_blocks[req.seq_id] = list(req.block_ids)
            n = to_compute if budget is None else min(to_compute, budget)
            out.prefills.append((req, n))
            if budget is not None:
                budget -= n
        return budget


def _first_prefill_start(ctx: ScheduleContext) -> int:
    """Computed tokens of the prefill that gets the next chunk (0 for a new request)."""
    for req in ctx.running:
        if req.is_prefill:
            return req.num_computed_tokens
    return 0


class SarathiPolicy(Policy):
    """Stall-free hybrid batches: all decodes, then running chunked prefills, then new
    prefills FCFS, filling `chunk_size` tokens (a decode counts one)."""

    name = "sarathi"

    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        out = BatchDecision()
        self._schedule_decodes(ctx, out)
        if ctx.prefill_budget is not None:
            budget = ctx.prefill_budget(out.decodes, _first_prefill_start(ctx))
        else:
            budget = self.chunk_size - len(out.decodes)
        out.token_budget = len(out.decodes) + max(budget, 0)
        if budget > 0:
            budget = self._schedule_running_prefills(ctx, out, budget)
            self._admit(ctx, out, budget, whole=False)
        return out


class VllmPolicy(Policy):
    """Prefill-first: if any waiting request can be admitted, the batch is only whole
    prefills (sum of lengths <= max(chunk_size, max_model_len)) and decodes stall;
    otherwise a decode-only batch of all running."""

    name = "vllm"

    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        out = BatchDecision()
        limit = max(self.chunk_size, self.max_model_len)
        self._admit(ctx, out, limit, whole=True)
        if out.prefills:
            out.token_budget = limit
            return out
        self._schedule_decodes(ctx, out)
        return out


class OrcaPolicy(Policy):
    """Iteration-level scheduling: all decodes plus whole new prompts FCFS, no token
    budget."""

    name = "orca"

    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        out = BatchDecision()
        self._schedule_decodes(ctx, out)
        self._admit(ctx, out, None, whole=True)
        return out


class FasterTransformerPolicy(Policy):
    """Request-level static batching: admit a batch of whole prompts only when nothing
    is running, then decode until every one has finished."""

    name = "fastertransformer"

    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        out = BatchDecision()
        if not ctx.running and not ctx.num_hidden:
            self._admit(ctx, out, None, whole=True)
            return out
        self._schedule_decodes(ctx, out)
        return out


class SimpleChunkingPolicy(Policy):
    """Chunked prefills without hybrid batches: prefill-only iterations (chunk_size
    tokens, like Sarathi's prefill part) alternate with decode-only iterations; when
    only one kind has work, that kind runs.

    State: the kind run last (per scheduler instance).
    """

    name = "simple_chunking"

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self._last_was_prefill = False

    def _prefill(self, ctx: ScheduleContext, out: BatchDecision) -> None:
        budget = self._schedule_running_prefills(ctx, out, self.chunk_size)
        self._admit(ctx, out, budget, whole=False)
        if out.prefills:
            out.token_budget = self.chunk_size

    def schedule(self, ctx: ScheduleContext) -> BatchDecision:
        out = BatchDecision()
        if self._last_was_prefill:
            self._schedule_decodes(ctx, out)
            if not out.decodes:
                self._prefill(ctx, out)
        else:
            self._prefill(ctx, out)
            if not out.prefills:
                self._schedule_decodes(ctx, out)
        if not out.empty:
            self._last_was_prefill = bool(out.prefills)
        return out


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        SarathiPolicy,
        VllmPolicy,
        OrcaPolicy,
        FasterTransformerPolicy,
        SimpleChunkingPolicy,
    )
}


def make_policy(config: SchedulerConfig, max_model_len: int | None = None) -> Policy:
    """The policy named by `config.policy`. max_model_len defaults to
    config.max_model_len (used by `vllm`'s token budget)."""
    try:
        cls = POLICY_CLASSES[config.policy]
    except KeyError:
        raise ValueError(
            f"unknown scheduler policy {config.policy!r}; choose one of {sorted(POLICY_CLASSES)}"
        ) from None
    return cls(config, config.max_model_len if max_model_len is None else max_model_len)
