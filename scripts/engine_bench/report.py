"""The benchmark's report: the main table against the roofline and transformers, the fused
decode step's A/B, the hybrid ratio, issue 6's goals, end-to-end and llama.cpp rows."""

from __future__ import annotations

from dataclasses import dataclass

from .common import (
    DECODE_BATCHES,
    DECODE_CTX,
    HYBRID_CHUNK,
    HYBRID_DECODES,
    INT8_DECODE_BATCHES,
    PREFILL_CHUNK,
    PROMPT_LEN,
)
from .cost import ModelCost


@dataclass
class Row:
    """One row of the main table."""

    name: str
    unit: str  # "tok/s" (higher is better) or "ms" (lower is better)
    limit: float
    ours: float
    hf: float | None = None
    util_label: str = ""  # "MFU" / "MBU"
    util: float | None = None


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "x":
        return f"{v:.2f}"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def print_table(rows: list[Row]) -> None:
    """The main table, as a Markdown table."""
    header = (
        f"| {'row':<44} | {'unit':<5} | {'limit':>8} | {'measured':>9} | {'of limit':>8} "
        f"| {'MFU/MBU':>9} | {'transformers':>12} | {'vs HF':>6} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        if r.unit == "ms":
            of_limit = r.limit / r.ours if r.ours else None
            vs = r.hf / r.ours if r.hf else None
        else:
            of_limit = r.ours / r.limit if r.limit else None
            vs = r.ours / r.hf if r.hf else None
        util = f"{r.util_label} {r.util:.2f}" if r.util is not None else ""
        print(
            f"| {r.name:<44} | {r.unit:<5} | {_fmt(r.limit or None, r.unit):>8} "
            f"| {_fmt(r.ours, r.unit):>9} | {_fmt(of_limit, 'x'):>8} | {util:>9} "
            f"| {_fmt(r.hf, r.unit):>12} | {_fmt(vs, 'x'):>6} |"
        )


@dataclass
class Measured:
    """Everything one run measured (seconds; end-to-end rows as (seconds, tokens)).

    ours / hf / llama_cpp: per row key ("prefill_chunked", "decode_1", ...), hf and
    llama_cpp empty where skipped; eager_ab: running sequences -> (fused step, op by op).
    """

    ours: dict[str, float]
    hf: dict[str, float]
    llama_cpp: dict[str, float]
    eager_ab: dict[int, tuple[float, float]]
    e2e_ours: tuple[float, int] | None
    e2e_hf: tuple[float, int] | None
    num_requests: int
    max_new: int


def print_report(
    m: Measured, cost: ModelCost, peak: float, bw: float, dtype_name: str, llama_cpp_note: str
) -> None:
    """Prints every table and summary line of the run. peak, bw: the machine's GEMM FLOP/s
    and read bytes/s; llama_cpp_note: why llama.cpp has no rows, where it has none."""

    def limit_s(q_lens: list[int], k_lens: list[int], sampled: int) -> float:
        return max(cost.flops(q_lens, k_lens, sampled) / peak, cost.bytes(k_lens) / bw)

    rows: list[Row] = []
    for key, label, chunk in (
        (
            "prefill_chunked",
            f"prefill {PROMPT_LEN} tok, {PREFILL_CHUNK}-token chunks",
            PREFILL_CHUNK,
        ),
        ("prefill_single", f"prefill {PROMPT_LEN} tok, single pass", PROMPT_LEN),
    ):
        starts = range(0, PROMPT_LEN, chunk)
        flops = sum(
            cost.flops([min(chunk, PROMPT_LEN - s)], [min(s + chunk, PROMPT_LEN)], 0)
            for s in starts
        )
        flops += cost.flops([0], [0], 1)  # the lm head of the last token
        lim = sum(
            limit_s([min(chunk, PROMPT_LEN - s)], [min(s + chunk, PROMPT_LEN)], 0) for s in starts
        )
        rows.append(
            Row(
                label,
                "tok/s",
                PROMPT_LEN / lim,
                PROMPT_LEN / m.ours[key],
                PROMPT_LEN / m.hf[key] if key in m.hf else None,
                "MFU",
                flops / m.ours[key] / peak,
            )
        )
    for b in DECODE_BATCHES:
        key = f"decode_{b}"
        k_lens = [DECODE_CTX] * b
        rows.append(
            Row(
                f"decode step, {b} running x {DECODE_CTX} ctx",
                "ms",
                1e3 * limit_s([1] * b, k_lens, b),
                1e3 * m.ours[key],
                1e3 * m.hf[key] if key in m.hf else None,
                "MBU",
                cost.bytes(k_lens) / m.ours[key] / bw,
            )
        )
    b = max(DECODE_BATCHES)
    rows.append(
        Row(
            f"decode output tok/s, {b} running",
            "tok/s",
            b / limit_s([1] * b, [DECODE_CTX] * b, b),
            b / m.ours[f"decode_{b}"],
            b / m.hf[f"decode_{b}"] if f"decode_{b}" in m.hf else None,
        )
    )
    d_q, d_k = [1] * HYBRID_DECODES, [DECODE_CTX] * HYBRID_DECODES
    c_q, c_k = [HYBRID_CHUNK], [2 * HYBRID_CHUNK]
    rows.append(
        Row(
            f"hybrid: {HYBRID_CHUNK}-tok chunk + {HYBRID_DECODES} decodes",
            "ms",
            1e3 * limit_s(d_q + c_q, d_k + c_k, HYBRID_DECODES + 1),
            1e3 * m.ours["hybrid"],
        )
    )
    rows.append(
        Row(
            f"  {HYBRID_CHUNK}-tok chunk alone",
            "ms",
            1e3 * limit_s(c_q, c_k, 1),
            1e3 * m.ours["chunk"],
        )
    )
    rows.append(
        Row(
            f"  {HYBRID_DECODES} decodes alone",
            "ms",
            1e3 * limit_s(d_q, d_k, HYBRID_DECODES),
            1e3 * m.ours["decodes"],
        )
    )
    if m.e2e_ours is not None:
        rows.append(
            Row(
                f"end-to-end LLM.generate, {m.num_requests} req x {m.max_new} out",
                "tok/s",
                0.0,
                m.e2e_ours[1] / m.e2e_ours[0],
                m.e2e_hf[1] / m.e2e_hf[0] if m.e2e_hf else None,
            )
        )
    print()
    print_table(rows)
    print()
    print(
        f"fused decode step vs op by op (--enforce-eager), {DECODE_CTX}-token contexts, "
        "timed alternately in this run:"
    )
    print("| running | fused step (ms) | op by op (ms) | speedup |")
    print("|---|---|---|---|")
    for b, (fused_s, eager_s) in m.eager_ab.items():
        print(f"| {b} | {1e3 * fused_s:.2f} | {1e3 * eager_s:.2f} | {eager_s / fused_s:.2f}x |")
    print()
    hyb = m.ours["hybrid"] / m.ours["chunk"]
    roof = limit_s(d_q + c_q, d_k + c_k, HYBRID_DECODES + 1) / limit_s(c_q, c_k, 1)
    print(
        f"hybrid / chunk alone: {hyb:.3f} (goal <= 1.10; at this machine's roofline "
        f"{roof:.3f}); hybrid / (chunk + decodes separately): "
        f"{m.ours['hybrid'] / (m.ours['chunk'] + m.ours['decodes']):.3f}"
    )
    # issue 6's goals (set on the PERF.md machine: ~70 GB/s, ~790 GFLOP/s bf16)
    goals = [
        ("decode, 1 running <= 8 ms/step", 1e3 * m.ours["decode_1"] <= 8.0),
        ("decode, 64 running <= 60 ms/step", 1e3 * m.ours["decode_64"] <= 60.0),
        (
            f"prefill, {PREFILL_CHUNK}-token chunks >= 2,000 tok/s",
            PROMPT_LEN / m.ours["prefill_chunked"] >= 2000,
        ),
        ("hybrid <= 1.10 x chunk alone", hyb <= 1.10),
    ]
    if m.e2e_ours is not None and m.e2e_hf:
        ratio = (m.e2e_ours[1] / m.e2e_ours[0]) / (m.e2e_hf[1] / m.e2e_hf[0])
        goals.append((f"end-to-end >= 3x generate_batch (here {ratio:.2f}x)", ratio >= 3.0))
    print("goals: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in goals))
    if m.e2e_ours is not None:
        print(
            f"end-to-end: ours {m.e2e_ours[1]} tokens in {m.e2e_ours[0]:.1f} s"
            + (
                f"; transformers generate_batch {m.e2e_hf[1]} tokens in {m.e2e_hf[0]:.1f} s"
                if m.e2e_hf
                else "; transformers generate_batch: not run"
            )
            + " (transformers e2e column: generate_batch; other rows: eager forward)"
        )
    if m.llama_cpp:
        pre, dec = PROMPT_LEN / m.llama_cpp["prefill_chunked"], m.llama_cpp["decode_1"]
        ours_pre, ours_dec = PROMPT_LEN / m.ours["prefill_chunked"], m.ours["decode_1"]
        print()
        print(
            "llama.cpp (llama-cpp-python, the GGUF's Q4_1 weights as stored, one sequence), "
            "same run:"
        )
        print(f"| row | llama.cpp | ours ({dtype_name}) | ours / llama.cpp |")
        print("|---|---|---|---|")
        print(
            f"| prefill {PROMPT_LEN} tok, {PREFILL_CHUNK}-token batches | {pre:,.0f} tok/s | "
            f"{ours_pre:,.0f} tok/s | {ours_pre / pre:.2f}x |"
        )
        print(
            f"| decode step, 1 running x {DECODE_CTX} ctx | {1e3 * dec:.2f} ms | "
            f"{1e3 * ours_dec:.2f} ms | {dec / ours_dec:.2f}x |"
        )
    else:
        print(f"llama.cpp: {llama_cpp_note}")


def int8_limit_s(
    cost: ModelCost,
    q_lens: list[int],
    k_lens: list[int],
    sampled: int,
    peak: float,
    bw: float,
    int8_peak: float,
) -> float:
    """The integer path's roofline for a batch: the decoder matmuls at the int8 probe's
    rate (int8_peak, ops/s), attention and the lm head at the float32 GEMM peak, or the
    bytes at the bandwidth, whichever takes longer."""
    total = cost.flops(q_lens, k_lens, sampled)
    linear = cost.base.linear_flops(sum(q_lens))
    return max(linear / int8_peak + (total - linear) / peak, cost.bytes(k_lens) / bw)


def print_int8_report(
    ours: dict[str, float],
    int8: dict[str, float],
    cost: ModelCost,
    peak: float,
    bw: float,
    int8_peak: float,
) -> list[tuple[str, bool]]:
    """The --int8 table: each row's times with float32 (`ours`) and int8 GGUF matmuls,
    int8's speedup, and its fraction of the integer path's limit (`int8_limit_s`); then
    issue 38's goals. Returns the goals as (name, met)."""
    print()
    print(
        f"integer path (gguf_matmul=int8; int8 probe {int8_peak / 1e9:,.0f} GOP/s, "
        f"{int8_peak / peak:.2f}x the float32 GEMM peak), float and int8 alternated run by "
        "run in this run (median):"
    )
    print("| row | float32 | int8 | int8 / float32 | int8 limit | of int8 limit |")
    print("|---|---|---|---|---|---|")
    speed: dict[str, float] = {}
    prefill = [
        (
            "prefill_chunked",
            f"prefill {PROMPT_LEN} tok, {PREFILL_CHUNK}-token chunks",
            PREFILL_CHUNK,
        ),
        ("prefill_single", f"prefill {PROMPT_LEN} tok, single pass", PROMPT_LEN),
    ]
    for key, label, chunk in prefill:
        starts = range(0, PROMPT_LEN, chunk)
        lim = sum(
            int8_limit_s(
                cost,
                [min(chunk, PROMPT_LEN - s)],
                [min(s + chunk, PROMPT_LEN)],
                0,
                peak,
                bw,
                int8_peak,
            )
            for s in starts
        )
        speed[key] = ours[key] / int8[key]
        print(
            f"| {label} | {PROMPT_LEN / ours[key]:,.0f} tok/s | {PROMPT_LEN / int8[key]:,.0f} "
            f"tok/s | {speed[key]:.2f}x | {PROMPT_LEN / lim:,.0f} tok/s | "
            f"{lim / int8[key]:.2f} |"
        )
    batches = sorted(int(k.split("_")[1]) for k in int8 if k.startswith("decode_"))
    for b in batches:
        key = f"decode_{b}"
        lim = int8_limit_s(cost, [1] * b, [DECODE_CTX] * b, b, peak, bw, int8_peak)
        speed[key] = ours[key] / int8[key]
        print(
            f"| decode step, {b} running x {DECODE_CTX} ctx | {1e3 * ours[key]:.2f} ms | "
            f"{1e3 * int8[key]:.2f} ms | {speed[key]:.2f}x | {1e3 * lim:.2f} ms | "
            f"{lim / int8[key]:.2f} |"
        )
    for key, label, q, k, sampled in (
        (
            "hybrid",
            f"hybrid: {HYBRID_CHUNK}-tok chunk + {HYBRID_DECODES} decodes",
            [1] * HYBRID_DECODES + [HYBRID_CHUNK],
            [DECODE_CTX] * HYBRID_DECODES + [2 * HYBRID_CHUNK],
            HYBRID_DECODES + 1,
        ),
        ("chunk", f"{HYBRID_CHUNK}-tok chunk alone", [HYBRID_CHUNK], [2 * HYBRID_CHUNK], 1),
    ):
        lim = int8_limit_s(cost, q, k, sampled, peak, bw, int8_peak)
        speed[key] = ours[key] / int8[key]
        print(
            f"| {label} | {1e3 * ours[key]:.2f} ms | {1e3 * int8[key]:.2f} ms | "
            f"{speed[key]:.2f}x | {1e3 * lim:.2f} ms | {lim / int8[key]:.2f} |"
        )
    chunk_lim = sum(
        int8_limit_s(cost, [PREFILL_CHUNK], [s + PREFILL_CHUNK], 0, peak, bw, int8_peak)
        for s in range(0, PROMPT_LEN, PREFILL_CHUNK)
    )
    goals = [
        (
            f"prefill in {PREFILL_CHUNK}-token chunks >= 1.5x float32",
            speed["prefill_chunked"] >= 1.5,
        ),
        (
            f"prefill in {PREFILL_CHUNK}-token chunks >= 0.8 of the int8 limit",
            chunk_lim / int8["prefill_chunked"] >= 0.8,
        ),
    ]
    goals += [
        (f"decode at {b} running >= 1.3x float32", speed[f"decode_{b}"] >= 1.3) for b in batches
    ]
    print("int8 goals: " + "; ".join(f"{n}: {'met' if ok else 'NOT met'}" for n, ok in goals))
    return goals


def print_kv_int8_report(
    ours: dict[str, float], int8: dict[str, float], kv_int8: dict[str, float]
) -> None:
    """The --int8-kv-cache table: each --int8 row with float32 matmuls, int8 matmuls, and
    int8 matmuls over an int8 KV cache (`kv_cache_dtype="int8"`), as ratios to float32
    over the model's own cache."""
    print()
    print(
        "int8 KV cache (kv_cache_dtype=int8, a second engine with int8 matmuls; its runs "
        "alternated with the float / int8 ones in this run):"
    )
    print("| row | float32 | int8 | int8 + int8 KV | int8 / float32 | int8 + int8 KV / float32 |")
    print("|---|---|---|---|---|---|")
    for key, label, unit in (
        ("prefill_chunked", f"prefill {PROMPT_LEN} tok, {PREFILL_CHUNK}-token chunks", "tok"),
        ("prefill_single", f"prefill {PROMPT_LEN} tok, single pass", "tok"),
        *(
            (f"decode_{b}", f"decode step, {b} running x {DECODE_CTX} ctx", "ms")
            for b in INT8_DECODE_BATCHES
        ),
        ("hybrid", f"hybrid: {HYBRID_CHUNK}-tok chunk + {HYBRID_DECODES} decodes", "ms"),
    ):
        times = (ours[key], int8[key], kv_int8[key])
        cells = (
            [f"{PROMPT_LEN / t:,.0f} tok/s" for t in times]
            if unit == "tok"
            else [f"{1e3 * t:.2f} ms" for t in times]
        )
        print(
            f"| {label} | {' | '.join(cells)} | {ours[key] / int8[key]:.2f}x | "
            f"{ours[key] / kv_int8[key]:.2f}x |"
        )
