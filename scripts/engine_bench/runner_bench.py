"""Our engine, driven at the `ModelRunner` level with hand-built plans of exact shapes."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from sarazmq import LLM
from sarazmq.perf.shapes_runner import ShapesRunner

from .common import DECODE_CTX, HYBRID_CHUNK, HYBRID_DECODES, PROMPT_LEN, median_time, time_once


class RunnerBench(ShapesRunner):
    """Drives `ModelRunner.execute` with hand-built plans of exact shapes (the package's
    `ShapesRunner`), for the benchmark's fixed shapes."""

    def __init__(self, llm: LLM) -> None:
        super().__init__(llm.engine.runner)

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
        model = self.runner.model

        def fused(on: bool) -> None:
            model.fused_decode = on

        return self._decode_ab(batch, runs, fused)

    def decode_graphs_ab(self, batch: int, runs: int) -> tuple[float, float]:
        """Seconds per decode step of `batch` requests (as `decode`) replayed from captured
        CUDA graphs and op by op, timed alternately: (graphs, eager). Where the runner has
        no graphs (a CPU) both are op by op."""
        graphs = self.runner.decode_graphs

        def replay(on: bool) -> None:
            self.runner.decode_graphs = graphs if on else None

        return self._decode_ab(batch, runs, replay)

    def _decode_ab(
        self, batch: int, runs: int, mode: Callable[[bool], None]
    ) -> tuple[float, float]:
        """Decode steps of `batch` requests timed alternately with `mode(True)` and
        `mode(False)` in force, each after a warm-up step in that mode (the other mode's
        buffers and cache state; a first graph replay); `mode(True)` again at the end."""
        seqs = [self.new_seq(DECODE_CTX, DECODE_CTX - 1) for _ in range(batch)]
        plan = self.plan([(s, DECODE_CTX - 1, 1, True) for s in seqs])

        def go() -> None:
            self.set_computed(seqs, DECODE_CTX - 1)
            self.run(plan)

        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for _ in range(runs):
                for on in (True, False):
                    mode(on)
                    go()
                    times[on].append(time_once(go))
        finally:
            mode(True)
            self.free_all()
        return statistics.median(times[True]), statistics.median(times[False])

    def hybrid(self, runs: int) -> tuple[float, float, float]:
        """Seconds for (chunk + decodes, chunk alone, decodes alone)."""
        steps = self.hybrid_steps()
        out = [
            median_time(lambda name=name: steps(name), runs)
            for name in ("hybrid", "chunk", "decodes")
        ]
        self.free_all()
        return out[0], out[1], out[2]

    def hybrid_steps(self) -> Callable[[str], None]:
        """Sets up the hybrid row's sequences; returns a function that runs one step of
        "hybrid" (chunk + decodes), "chunk" (alone) or "decodes" (alone) from the same
        state each time. `free_all` ends them."""
        decs = [self.new_seq(DECODE_CTX, DECODE_CTX - 1) for _ in range(HYBRID_DECODES)]
        chunk_seq = self.new_seq(2 * HYBRID_CHUNK, HYBRID_CHUNK)
        dec_items = [(s, DECODE_CTX - 1, 1, True) for s in decs]
        chunk_item = (chunk_seq, HYBRID_CHUNK, HYBRID_CHUNK, True)
        plans = {
            "hybrid": self.plan(dec_items + [chunk_item]),
            "chunk": self.plan([chunk_item]),
            "decodes": self.plan(dec_items),
        }

        def step(name: str) -> None:
            self.set_computed(decs, DECODE_CTX - 1)
            self.set_computed([chunk_seq], HYBRID_CHUNK)
            self.run(plans[name])

        return step
