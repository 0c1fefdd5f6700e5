"""Engine benchmark: prefill, decode and hybrid iterations against this machine's limits and
against Hugging Face transformers on the same model, all measured in one run.

    python scripts/bench_engine.py [--dtype float32|bfloat16] [--runs 5] [--quick]
    python scripts/bench_engine.py --load-format dummy --model llama-2-7b --dtype bfloat16
    python scripts/bench_engine.py --int8 --no-hf --no-e2e   # + the GGUF's int8 rows

`--load-format dummy` measures a model of the named architecture's shapes with random
weights (no checkpoint needed; transformers and llama.cpp, which need one, are skipped).

What it measures (median of --runs timed repetitions after one warm-up each):

- the machine: GEMM peak (2048^3 matmul in the run dtype, best of 3) and memory read
  bandwidth (sum over a 512 MB buffer, best of 3), at the start and at the end of the run
  (the best of both is used: other users of a shared machine only ever lower them);
- our model, driven at the `ModelRunner` level with hand-built `BatchPlan`s so batch shapes
  are exact: prefill of a 2,048-token prompt (512-token chunks, and one pass), decode steps
  at 1, 16 and 64 running requests with 512-token contexts, the hybrid iteration (a
  256-token prefill chunk at positions 256..511 plus 32 decodes) against the chunk alone;
  and decode steps of 1, 4 and 8 running with the fused one-call decode step against the
  same op by op (`enforce_eager`), the two timed alternately;
- end to end: `LLM.generate` on a batch of requests (output tokens per second);
- transformers on the same GGUF in the same dtype (dequantized nn.Linear weights, default
  SDPA attention): eager forward passes of the same shapes (DynamicCache, logits of the
  last position only, as its `generate` does), and its continuous batching
  `generate_batch` (16-token pages, 256-token batches) on the same requests;
- llama.cpp on the same GGUF (its Q4_1 weights as stored), only if `llama_cpp`
  (llama-cpp-python) is importable: prefill and a one-sequence decode step;
- with --int8 (a GGUF model in float32): the prefill, decode and hybrid rows with the
  GGUF matmuls set to "float" and to "int8" (llama.cpp-style integer dot products, issue
  38), alternated run by run, against each other and against the integer path's limits:
  matmul FLOPs at the int8 probe's rate (`probe_peak_macs`: VPMADDUBSW or VPDPBUSD
  chains), attention and the lm head at the float32 GEMM peak, or the bytes at the
  bandwidth; with --int8-kv-cache also a second engine's int8 matmuls over an int8 KV
  cache (`--kv-cache-dtype int8`), alternated with them.

The main table runs the engine as configured (`--gguf-matmul`, default auto: int8 for a
GGUF model in float32 where it was measured faster, `sarazmq.resolve.resolve_gguf_matmul`).

Limits (the "limit" column): the roofline of each batch, max(FLOPs / GEMM peak,
bytes / bandwidth). FLOPs count the matmuls actually needed (linear layers, causal
attention, the lm head for sampled rows); bytes count every weight once plus the KV
cache the batch reads. "of limit" is limit/measured for times (measured/limit for rates),
so 1.0 means at the roofline. MFU = model FLOP/s over the GEMM peak (prefill); MBU = bytes
moved per step over the step time, over the bandwidth (decode). "vs HF" is how many times
faster ours is than transformers (> 1: ours faster).

KV blocks are handed out from a shuffled pool (as in a fragmented server), so every
sequence's KV is scattered over the cache. Decode and hybrid rows need sequences with 512
tokens already in the KV cache. Prefilling 64 x 512 tokens first would take most of the
time budget, so the bench registers the sequences with a `NewSeq` plan and then declares
their first 511 positions computed (`ModelRunner.assume_computed`; the cache holds zeros
there). Attention costs the same whatever the cached values are, so step times are those
of real 512-token contexts.

The parts live in scripts/engine_bench/ (shapes and timing, model costs, the runner-level
bench, the transformers and llama.cpp baselines, the report).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from engine_bench.baselines import HFBench, LlamaCppBench, e2e_requests, llama_cpp_available
from engine_bench.common import (
    DECODE_BATCHES,
    DECODE_CTX,
    EAGER_AB_BATCHES,
    HYBRID_CHUNK,
    INT8_DECODE_BATCHES,
    PREFILL_CHUNK,
    PROMPT_LEN,
    measure_machine,
)
from engine_bench.cost import model_cost
from engine_bench.report import (
    Measured,
    print_int8_report,
    print_kv_int8_report,
    print_report,
)
from engine_bench.runner_bench import RunnerBench

from sarazmq import LLM, SamplingParams
from sarazmq.config import GGUF_MATMULS, KV_CACHE_DTYPES, LOAD_FORMATS
from sarazmq.kernels.int8_dot import probe_peak_macs
from sarazmq.options import EngineOptions

# the shared traces folder beside the repository (../shared/traces)
DEFAULT_E2E_TRACE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "shared",
    "traces",
    "azure_llm_2023_conv.csv",
)


def measure_gguf_matmuls(
    llm: LLM, bench: RunnerBench, runs: int, kv_int8: RunnerBench | None = None
) -> tuple[dict[str, float], dict[str, float], dict[str, float]] | None:
    """The --int8 rows (prefill, decode at 16 and 64 running, hybrid and its chunk), each
    timed with the model's GGUF matmuls set to "float" and to "int8" (and on `kv_int8`, a
    second engine with int8 matmuls over an int8 KV cache) in turn, one run each round
    (each after its own warm-up run), the median of `runs` rounds: a shared machine's
    drift hits every column alike. The matmuls are then set back to the engine's choice.
    Returns (float, int8, kv_int8), the last empty without a second engine; None where
    no weight takes int8."""
    model = llm.engine.runner.model
    engine_mode = llm.engine.config.gguf_matmul
    if model.set_gguf_matmul("int8") == 0:
        model.set_gguf_matmul(engine_mode)
        return None
    rows: dict[str, dict[str, float]] = {"float": {}, "int8": {}, "kv_int8": {}}
    keys = ["prefill_chunked", "prefill_single", *(f"decode_{n}" for n in INT8_DECODE_BATCHES)]
    # column -> (its engine's bench, the matmul mode to set there; None: as built)
    columns: dict[str, tuple[RunnerBench, str | None]] = {
        "float": (bench, "float"),
        "int8": (bench, "int8"),
    }
    if kv_int8 is not None:
        columns["kv_int8"] = (kv_int8, None)
    try:
        for key in [*keys, "hybrid"]:
            samples: dict[str, list[tuple[float, ...]]] = {c: [] for c in columns}
            for _ in range(runs):
                for column, (column_bench, mode) in columns.items():
                    if mode is not None:
                        model.set_gguf_matmul(mode)
                    samples[column].append(_measure_once(key, column_bench))
            for column in columns:
                times = [statistics.median(t) for t in zip(*samples[column], strict=True)]
                if key == "hybrid":
                    rows[column]["hybrid"], rows[column]["chunk"] = times
                else:
                    rows[column][key] = times[0]
    finally:
        model.set_gguf_matmul(engine_mode)
    return rows["float"], rows["int8"], rows["kv_int8"]


def _measure_once(key: str, bench: RunnerBench) -> tuple[float, ...]:
    """One timed run (after a warm-up run) of the --int8 shape `key` on `bench`: (seconds,),
    for the hybrid shape (hybrid step, its chunk alone)."""
    if key == "hybrid":
        hybrid, chunk, _ = bench.hybrid(1)
        return hybrid, chunk
    if key.startswith("decode_"):
        return (bench.decode(int(key.removeprefix("decode_")), 1),)
    return (bench.prefill(PREFILL_CHUNK if key == "prefill_chunked" else PROMPT_LEN, 1),)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--model", default=EngineOptions.model, help="as `sarazmq serve --model`")
    ap.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="dummy: random weights of the model's shapes (--model may name an architecture)",
    )
    ap.add_argument("--runs", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--quick", action="store_true", help="2 runs, small end-to-end batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (cpu = native kernels where they build), cpu, torch",
    )
    ap.add_argument(
        "--gguf-matmul",
        default="auto",
        choices=GGUF_MATMULS,
        help="as `sarazmq serve --gguf-matmul`, for the main table",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="as `sarazmq serve --kv-cache-dtype`, for every row of ours",
    )
    ap.add_argument(
        "--int8",
        action="store_true",
        help="also float against int8 GGUF matmuls, row by row (a GGUF model in float32)",
    )
    ap.add_argument(
        "--int8-kv-cache",
        action="store_true",
        help="with --int8: also int8 matmuls over an int8 KV cache (a second engine, its "
        "rows timed beside the float / int8 pair)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end rows")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--e2e-requests", type=int, default=0, help="0: 16 (8 with --quick)")
    ap.add_argument(
        "--e2e-trace",
        default=DEFAULT_E2E_TRACE if os.path.exists(DEFAULT_E2E_TRACE) else "",
        help="trace whose prompt lengths the end-to-end rows use ('' = synthetic)",
    )
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    if args.int8 and args.dtype != "float32":
        ap.error("--int8 compares against the float32 path: use --dtype float32")
    if args.int8_kv_cache and not args.int8:
        ap.error("--int8-kv-cache adds a column to the --int8 rows: pass --int8 too")
    runs = 2 if args.quick else args.runs
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    print(
        f"bench_engine: model={args.model} load_format={args.load_format} "
        f"dtype={args.dtype} runs={runs} threads={torch.get_num_threads()} "
        f"attention={args.attention_backend} kv_cache={args.kv_cache_dtype} "
        f"torch={torch.__version__}",
        flush=True,
    )

    peak, bw = measure_machine(dtype, args.quick)
    int8_probe_start = probe_peak_macs(True) if args.int8 else 0.0
    print(
        f"machine: GEMM peak {peak / 1e9:,.0f} GFLOP/s ({args.dtype}), "
        f"read bandwidth {bw / 1e9:,.1f} GB/s",
        flush=True,
    )

    num_blocks = (
        max(DECODE_BATCHES) * -(-DECODE_CTX // 16)
        + -(-PROMPT_LEN // 16)
        + 2 * -(-HYBRID_CHUNK // 16)
        + 64
    )
    prompts, max_new, e2e_source = e2e_requests(
        args.e2e_requests or (8 if args.quick else 16), args.quick, args.e2e_trace or None
    )
    print(f"end-to-end requests: {len(prompts)} x {max_new} output tokens, {e2e_source}")
    num_blocks = max(num_blocks, sum(-(-(len(p) + max_new) // 16) for p in prompts) + 64)
    dummy = args.load_format == "dummy"

    def engine(gguf_matmul: str, kv_cache_dtype: str) -> LLM:
        """The benchmarked engine (the --int8-kv-cache column's differs in these two)."""
        return LLM(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            num_kv_blocks=num_blocks,
            max_model_len=PROMPT_LEN + 64,
            max_num_seqs=64,
            num_threads=args.threads,
            attention_backend=args.attention_backend,
            gguf_matmul=gguf_matmul,
            kv_cache_dtype=kv_cache_dtype,
        )

    llm = engine(args.gguf_matmul, args.kv_cache_dtype)
    cost = model_cost(llm, dtype)
    print(
        f"attention backend in use: {llm.engine.runner.model.attention.name}; GGUF matmuls: "
        f"{llm.engine.config.gguf_matmul} (`--gguf-matmul`, auto resolved)",
        flush=True,
    )
    if cost.block_weight_bytes is not None:
        plain = (cost.linear_params + cost.head_params) * cost.elem
        print(
            f"decode steps of up to {cost.block_rows} sequences read the GGUF's quantized "
            f"blocks: {cost.block_weight_bytes / 1e6:,.0f} MB of weights a step instead of "
            f"{plain / 1e6:,.0f} MB (bitwise the same results; the limits below count the "
            "bytes each step reads)",
            flush=True,
        )

    bench = RunnerBench(llm)
    ours: dict[str, float] = {}
    ours["prefill_chunked"] = bench.prefill(PREFILL_CHUNK, runs)
    ours["prefill_single"] = bench.prefill(PROMPT_LEN, runs)
    for b in DECODE_BATCHES:
        ours[f"decode_{b}"] = bench.decode(b, runs)
    ours["hybrid"], ours["chunk"], ours["decodes"] = bench.hybrid(runs)
    runner = llm.engine.runner
    fused_step = runner.model.fused_decode_step(runner.kv_caches)
    max_fused = fused_step.max_rows if fused_step is not None else 0
    eager_ab = {
        b: bench.decode_eager_ab(b, runs) for b in EAGER_AB_BATCHES if b <= max(max_fused, 1)
    }
    print(f"ours done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    kv_int8_llm = engine("int8", "int8") if args.int8_kv_cache else None
    gguf_rows = (
        measure_gguf_matmuls(
            llm, bench, runs, None if kv_int8_llm is None else RunnerBench(kv_int8_llm)
        )
        if args.int8
        else None
    )
    del kv_int8_llm
    if gguf_rows is not None:
        print(f"ours float / int8 done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    e2e_ours = None
    if not args.no_e2e:
        params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        e2e_ours = (time.perf_counter() - t0, sum(len(o.token_ids) for o in outs))
        print(f"ours e2e done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    del bench, llm

    hf: dict[str, float] = {}
    e2e_hf = None
    if not (args.no_hf or dummy):  # transformers and llama.cpp need the checkpoint
        hfb = HFBench(dtype)
        hf["prefill_chunked"] = hfb.prefill(PREFILL_CHUNK, runs)
        hf["prefill_single"] = hfb.prefill(PROMPT_LEN, runs)
        for b in DECODE_BATCHES:
            hf[f"decode_{b}"] = hfb.decode(b, runs)
        print(f"transformers done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if not args.no_e2e:
            e2e_hf = hfb.generate_batch(prompts, max_new)
            print(f"transformers e2e done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        del hfb

    llama_cpp: dict[str, float] = {}
    if llama_cpp_available() and not (args.no_llama_cpp or dummy):
        lcb = LlamaCppBench(args.threads)
        llama_cpp["prefill_chunked"] = lcb.prefill(runs)
        llama_cpp["decode_1"] = lcb.decode(runs)
        print(f"llama.cpp done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        del lcb

    # the machine is shared: measure again and keep the best of both as its capability
    peak2, bw2 = measure_machine(dtype, args.quick)
    print(
        f"machine again: GEMM peak {peak2 / 1e9:,.0f} GFLOP/s, read bandwidth "
        f"{bw2 / 1e9:,.1f} GB/s; limits use the best: {max(peak, peak2) / 1e9:,.0f} GFLOP/s, "
        f"{max(bw, bw2) / 1e9:,.1f} GB/s",
        flush=True,
    )
    peak, bw = max(peak, peak2), max(bw, bw2)
    measured = Measured(ours, hf, llama_cpp, eager_ab, e2e_ours, e2e_hf, len(prompts), max_new)
    skipped = "skipped (--no-llama-cpp)" if llama_cpp_available() else "not installed (skipped)"
    print_report(measured, cost, peak, bw, args.dtype, skipped)
    if args.int8:
        if gguf_rows is None:
            print("\n--int8: the model has no Q4/Q8 GGUF blocks in float32; no int8 rows")
        else:
            int8_peak = 2 * max(probe_peak_macs(True), int8_probe_start)
            print_int8_report(*gguf_rows[:2], cost, peak, bw, int8_peak)
            if gguf_rows[2]:
                print_kv_int8_report(*gguf_rows)
    print(f"total {time.perf_counter() - t_start:.0f} s; command: python {' '.join(sys.argv)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
