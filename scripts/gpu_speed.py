"""scripts/gpu_check.py's speed part: a random-weight model of real shapes driven at the
`ModelRunner` level with scripts/bench_engine.py's shapes, against its rooflines; decode
steps replayed from CUDA graphs and op by op; the Triton backend's elementwise ops
against torch's; and, on request, where an op-by-op step's host time goes (cProfile)."""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine_bench.runner_bench import RunnerBench

    from sarazmq.worker.model_runner import ModelRunner


def part_speed(
    device: torch.device, arch: str, limits: dict[str, float], quick: bool, host: bool = False
) -> list[str]:
    """Prefill and decode of a random-weight model of `arch` against its rooflines."""
    from engine_bench.common import (
        DECODE_CTX,
        HYBRID_CHUNK,
        HYBRID_DECODES,
        PREFILL_CHUNK,
        PROMPT_LEN,
    )
    from engine_bench.cost import model_cost
    from engine_bench.runner_bench import RunnerBench

    from sarazmq import LLM
    from sarazmq.kernels.cpu_ops import TORCH_OPS

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = (1, 16) if quick else (1, 16, 64)
    running = max(*batches, HYBRID_DECODES + 1)
    blocks = running * -(-DECODE_CTX // 16) + -(-PROMPT_LEN // 16) + 64
    llm = LLM(
        model=arch,
        load_format="dummy",
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        num_kv_blocks=blocks,
        max_model_len=PROMPT_LEN + 64,
        max_num_seqs=64,
    )
    cost = model_cost(llm, dtype)
    bench = RunnerBench(llm)
    runs = 2 if quick else 5
    rows = ["| shape | measured | limit | of limit | op by op | graphs / op by op |"]
    rows.append("|---|---|---|---|---|---|")
    chunks = list(range(0, PROMPT_LEN, PREFILL_CHUNK))
    flops = sum(
        cost.flops([PREFILL_CHUNK], [s + PREFILL_CHUNK], 1 if s == chunks[-1] else 0)
        for s in chunks
    )
    t = bench.prefill(PREFILL_CHUNK, runs)
    limit = flops / limits["flops"]
    rows.append(
        f"| prefill {PROMPT_LEN} in {PREFILL_CHUNK}-token chunks | {PROMPT_LEN / t:,.0f} tok/s "
        f"| {PROMPT_LEN / limit:,.0f} tok/s | {limit / t:.2f} | | |"
    )
    runner = llm.engine.runner
    attention = runner.model.attention
    fused_ops = attention.ops
    if fused_ops is not TORCH_OPS:  # the same op by op with torch's elementwise ops
        attention.ops = TORCH_OPS
        try:
            t_torch = bench.prefill(PREFILL_CHUNK, runs)
        finally:
            attention.ops = fused_ops
        rows.append(
            f"| prefill, torch's elementwise ops | {PROMPT_LEN / t_torch:,.0f} tok/s | | "
            f"{limit / t_torch:.2f} | | {fused_ops.name} ops {t_torch / t:.2f}x |"
        )
    graphs = runner.decode_graphs
    for b in batches:
        # decode steps replayed from CUDA graphs (where the runner has them) and op by op
        t, t_eager = bench.decode_graphs_ab(b, runs)
        k_lens = [DECODE_CTX] * b
        limit = max(cost.flops([1] * b, k_lens, b) / limits["flops"],
                    cost.bytes(k_lens) / limits["bandwidth"])  # fmt: skip
        ratio = f"{t_eager / t:.2f}x" if graphs is not None else "(no graphs)"
        rows.append(
            f"| decode, {b} running at {DECODE_CTX} tokens | {b / t:,.0f} tok/s | "
            f"{b / limit:,.0f} tok/s | {limit / t:.2f} | {b / t_eager:,.0f} tok/s | {ratio} |"
        )
        if fused_ops is not TORCH_OPS and b == batches[-1]:
            attention.ops, runner.decode_graphs = TORCH_OPS, None
            try:
                t_torch = bench.decode(b, runs)
            finally:
                attention.ops, runner.decode_graphs = fused_ops, graphs
            rows.append(
                f"| decode, {b} running, op by op with torch's elementwise ops | "
                f"{b / t_torch:,.0f} tok/s | | {limit / t_torch:.2f} | | "
                f"{fused_ops.name} ops {t_torch / t_eager:.2f}x op by op |"
            )
    # Sarathi's hybrid batch: a prompt chunk with decodes piggybacked (op by op: graphs
    # take decode-only batches), against the chunk alone
    t_hybrid, t_chunk, _ = bench.hybrid(runs)
    k_lens = [DECODE_CTX] * HYBRID_DECODES + [2 * HYBRID_CHUNK]
    q_lens = [1] * HYBRID_DECODES + [HYBRID_CHUNK]
    limit = max(cost.flops(q_lens, k_lens, HYBRID_DECODES + 1) / limits["flops"],
                cost.bytes(k_lens) / limits["bandwidth"])  # fmt: skip
    rows.append(
        f"| hybrid: {HYBRID_CHUNK}-token chunk + {HYBRID_DECODES} decodes | "
        f"{t_hybrid * 1e3:.2f} ms | {limit * 1e3:.2f} ms | {limit / t_hybrid:.2f} | | "
        f"hybrid / chunk alone {t_hybrid / t_chunk:.2f} |"
    )
    out = [f"{arch}, random weights, {dtype}, attention {attention.name}:", "", *rows]
    if graphs is not None:
        out += ["", f"{len(graphs.captured_sizes)} decode graphs (batches 1..{graphs.max_batch}) "
                f"captured at startup in {graphs.capture_seconds:.1f} s"]  # fmt: skip
    if host:
        out += ["", *host_profile(bench, runner, min(16, max(batches)))]
    return out


def host_profile(bench: RunnerBench, runner: ModelRunner, batch: int) -> list[str]:
    """Where the host time of op-by-op steps goes: cProfile's top functions by their own
    time over 10 decode steps of `batch`, then over 10 hybrid steps (bench_engine's
    chunk + decodes), whose wall time on the H200 was ~3x their kernels' (docs/GPU.md)."""
    graphs = runner.decode_graphs
    runner.decode_graphs = None
    out: list[str] = []
    try:
        bench.decode(batch, 1)  # warm-up
        out += _profiled(f"op-by-op decode steps of {batch}", lambda: bench.decode(batch, 10))
        steps = bench.hybrid_steps()
        try:
            steps("hybrid")  # warm-up
            out += ["", *_profiled("hybrid steps", lambda: [steps("hybrid") for _ in range(10)])]
        finally:
            bench.free_all()
    finally:
        runner.decode_graphs = graphs
    return out


def _profiled(what: str, run: Callable[[], object]) -> list[str]:
    """cProfile's 25 functions of most own time while `run` runs (10 steps)."""
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    return [f"Host time of {what} (cProfile, 10 steps):", "```", *lines[-30:], "```"]
