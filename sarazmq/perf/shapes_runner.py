"""Timing iterations of exact shapes on a `ModelRunner`, with hand-built plans.

A long context is faked, not prefilled: `ModelRunner.assume_computed` declares a sequence's
first positions computed in blocks whatever they hold, so a decode at context 2048 costs one
step to set up. What is timed is `ModelRunner.execute` of the plan (metadata, the forward
pass, the LM head and sampling): the engine's `forward_s`, without the scheduler's part.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from sarazmq.perf.machine import time_once
from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import IterationShape, shape_of
from sarazmq.worker import ModelRunner


class ShapesRunner:
    """Drives `ModelRunner.execute` with hand-built plans of exact shapes.

    wrap_blocks: when the KV pool runs out, hand out its blocks again (sequences then share
    blocks: fine for timing, the values are never read back as results); False raises.
    """

    def __init__(self, runner: ModelRunner, wrap_blocks: bool = False) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.num_blocks = runner.kv_caches[0][0].shape[0]
        self.wrap_blocks = wrap_blocks
        # blocks handed out in a shuffled order: a long-running server's pool is
        # fragmented, so a sequence's blocks are scattered over the cache
        self.pool = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(0))
        self.next_block = 0
        self.next_seq = 1_000_000  # far from an engine's own ids
        self.step = 0
        self.params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        vocab = runner.model.config.vocab_size
        # token ids away from the special ones at the start where the vocabulary allows
        self.token_offset = 100 if vocab > 200 else 0
        self.token_span = min(30000, vocab - self.token_offset)

    def blocks(self, num_tokens: int) -> list[int]:
        """Block ids for `num_tokens` positions, from the shuffled pool."""
        n = -(-num_tokens // self.block_size)
        if self.next_block + n > self.num_blocks:
            if not self.wrap_blocks or n > self.num_blocks:
                raise RuntimeError(
                    f"KV pool of {self.num_blocks} blocks too small for {num_tokens} more tokens"
                )
            self.next_block = 0
        ids = self.pool[self.next_block : self.next_block + n].tolist()
        self.next_block += n
        return ids

    def run(self, plan: BatchPlan) -> None:
        self.runner.execute(plan)

    def new_seq(self, num_tokens: int, computed: int) -> int:
        """Registers a sequence of `num_tokens` tokens whose first `computed` are cached."""
        seq_id = self.next_seq
        self.next_seq += 1
        tokens = [
            (seq_id * 31 + i * 7) % self.token_span + self.token_offset for i in range(num_tokens)
        ]
        self.step += 1
        self.run(
            BatchPlan(
                step=self.step,
                new_seqs=[NewSeq(seq_id, tokens, num_tokens, self.params, seed=0)],
            )
        )
        self.runner.assume_computed(seq_id, computed, self.blocks(num_tokens))
        return seq_id

    def set_computed(self, seq_ids: Sequence[int], computed: int) -> None:
        for s in seq_ids:
            self.runner.assume_computed(s, computed, self.runner.sequence(s).block_ids)

    def plan(self, items: Sequence[tuple[int, int, int, bool]]) -> BatchPlan:
        """items: (seq_id, start_pos, num_tokens, sample)."""
        self.step += 1
        return BatchPlan(
            step=self.step,
            scheduled=[ScheduledSeq(s, p, n, sample=smp) for s, p, n, smp in items],
        )

    def free_all(self) -> None:
        self.step += 1
        self.run(BatchPlan(step=self.step, freed_seq_ids=self.runner.sequence_ids()))
        self.next_block = 0

    def time_iteration(
        self,
        prefills: Sequence[tuple[int, int]],
        decode_contexts: Sequence[int],
        runs: int = 3,
        warmup: int = 1,
    ) -> tuple[IterationShape, float]:
        """Median seconds of `runs` timed runs (after `warmup` untimed ones) of one iteration
        with prefill chunks (start, num_tokens), each sampling (the chunk that ends a
        prompt), and decodes reading these contexts (a decode at context c computes
        position c - 1); and the iteration's shape."""
        if runs < 1:
            raise ValueError(f"runs={runs} must be >= 1")
        if not prefills and not decode_contexts:
            raise ValueError("an iteration needs a prefill chunk or a decode")
        decodes = [(self.new_seq(c, c - 1), c - 1) for c in decode_contexts]
        chunks = [(self.new_seq(start + n, start), start, n) for start, n in prefills]
        items = [(s, p, 1, True) for s, p in decodes]
        items += [(s, start, n, True) for s, start, n in chunks]
        plan = self.plan(items)

        def reset() -> None:
            for s, p in decodes:
                self.runner.assume_computed(s, p, self.runner.sequence(s).block_ids)
            for s, start, _ in chunks:
                self.runner.assume_computed(s, start, self.runner.sequence(s).block_ids)

        times = []
        try:
            for i in range(warmup + runs):  # the warm-up runs (first) are not timed
                reset()
                t = time_once(lambda: self.run(plan))
                if i >= warmup:
                    times.append(t)
        finally:
            self.free_all()
        seconds = statistics.median(times)
        shape = shape_of(((st, n, True) for st, n in prefills), (c - 1 for c in decode_contexts))
        return shape, seconds
