"""Our engine, driven at the `ModelRunner` level with hand-built plans of exact shapes."""

from __future__ import annotations

import statistics

import torch

from sarazmq import LLM, SamplingParams
from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq

from .common import DECODE_CTX, HYBRID_CHUNK, HYBRID_DECODES, PROMPT_LEN, median_time, time_once


class RunnerBench:
    """Drives `ModelRunner.execute` with hand-built plans of exact shapes."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.block_size = self.runner.block_size
        self.num_blocks = self.runner.kv_caches[0][0].shape[0]
        # blocks handed out in a shuffled order: a long-running server's pool is
        # fragmented, so a sequence's blocks are scattered over the cache
        self.pool = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(0))
        self.next_block = 0
        self.next_seq = 1_000_000  # far from the engine's own ids
        self.step = 0
        self.params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        if self.next_block + n > self.num_blocks:
            raise RuntimeError("KV pool too small for the benchmark")
        ids = self.pool[self.next_block : self.next_block + n].tolist()
        self.next_block += n
        return ids

    def run(self, plan: BatchPlan) -> None:
        self.runner.execute(plan)

    def new_seq(self, num_tokens: int, computed: int) -> int:
        """Registers a sequence of `num_tokens` tokens whose first `computed` are cached."""
        seq_id = self.next_seq
        self.next_seq += 1
        tokens = [(seq_id * 31 + i * 7) % 30000 + 100 for i in range(num_tokens)]
        self.step += 1
        self.run(
            BatchPlan(
                step=self.step,
                new_seqs=[NewSeq(seq_id, tokens, num_tokens, self.params, seed=0)],
            )
        )
        self.runner.assume_computed(seq_id, computed, self._blocks(num_tokens))
        return seq_id

    def set_computed(self, seq_ids: list[int], computed: int) -> None:
        for s in seq_ids:
            self.runner.assume_computed(s, computed, self.runner.sequence(s).block_ids)

    def plan(self, items: list[tuple[int, int, int, bool]]) -> BatchPlan:
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

    # --- the measured shapes

    def prefill(self, chunk: int, runs: int) -> float:
        """Seconds to prefill one PROMPT_LEN prompt in chunks of `chunk` tokens."""
        seq = self.new_seq(PROMPT_LEN, 0)
        plans = [
            self.plan([(seq, s, min(chunk, PROMPT_LEN - s), s + chunk >= PROMPT_LEN)])
            for s in range(0, PROMPT_LEN, chunk)
        ]

        def go() -> None:
            self.set_computed([seq], 0)
            for p in plans:
                self.run(p)

        t = median_time(go, runs)
        self.free_all()
        return t

    def decode(self, batch: int, runs: int) -> float:
        """Seconds per decode step of `batch` requests at DECODE_CTX-token contexts."""
        seqs = [self.new_seq(DECODE_CTX, DECODE_CTX - 1) for _ in range(batch)]
        plan = self.plan([(s, DECODE_CTX - 1, 1, True) for s in seqs])

        def go() -> None:
            self.set_computed(seqs, DECODE_CTX - 1)
            self.run(plan)

        t = median_time(go, runs)
        self.free_all()
        return t

    def decode_eager_ab(self, batch: int, runs: int) -> tuple[float, float]:
        """Seconds per decode step of `batch` requests (as `decode`), with the model's fused
        one-call decode step and op by op (`enforce_eager`), timed alternately so that a
        shared machine's drift hits both alike: (fused, eager)."""
        seqs = [self.new_seq(DECODE_CTX, DECODE_CTX - 1) for _ in range(batch)]
        plan = self.plan([(s, DECODE_CTX - 1, 1, True) for s in seqs])
        model = self.runner.model

        def go() -> None:
            self.set_computed(seqs, DECODE_CTX - 1)
            self.run(plan)

        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for _ in range(runs):
                for fused in (True, False):
                    model.fused_decode = fused
                    go()  # warm-up: the other mode's buffers and cache state
                    times[fused].append(time_once(go))
        finally:
            model.fused_decode = True
            self.free_all()
        return statistics.median(times[True]), statistics.median(times[False])

    def hybrid(self, runs: int) -> tuple[float, float, float]:
        """Seconds for (chunk + decodes, chunk alone, decodes alone)."""
        decs = [self.new_seq(DECODE_CTX, DECODE_CTX - 1) for _ in range(HYBRID_DECODES)]
        chunk_seq = self.new_seq(2 * HYBRID_CHUNK, HYBRID_CHUNK)
        dec_items = [(s, DECODE_CTX - 1, 1, True) for s in decs]
        chunk_item = (chunk_seq, HYBRID_CHUNK, HYBRID_CHUNK, True)
        plans = {
            "hybrid": self.plan(dec_items + [chunk_item]),
            "chunk": self.plan([chunk_item]),
            "decodes": self.plan(dec_items),
        }
        out = []
        for name in ("hybrid", "chunk", "decodes"):

            def go(p: BatchPlan = plans[name]) -> None:
                self.set_computed(decs, DECODE_CTX - 1)
                self.set_computed([chunk_seq], HYBRID_CHUNK)
                self.run(p)

            out.append(median_time(go, runs))
        self.free_all()
        return out[0], out[1], out[2]
