"""The GPU path's check, for the few minutes a device is lent (docs/GPU.md; run by
scripts/gpu_check.sh, which installs first). Writes a Markdown report:

1. the device and what imports (torch, CUDA, Triton, flash-attn), and its limits measured
   in this run: a bf16 matmul's FLOP/s and a large read's bytes/s;
2. the attention kernels on the device against the torch reference (Triton; flash-attn
   where it imports): hybrid batches of decodes and prompt chunks over paged contexts;
3. exactness: greedy tokens of the default model on the device (float32) against the
   CPU float32 path, per prompt;
4. speed at real shapes: a random-weight model (`--load-format dummy`, default
   llama-3-8b, bf16) driven at the `ModelRunner` level with the shapes of
   scripts/bench_engine.py: prefill of 2,048 tokens in 512-token chunks and decode steps
   at 1, 16 and 64 running, each against its roofline limit from the limits of part 1.

Every part runs on its own: a failing part is reported and the next one runs.
`--device cpu` runs the same code on the CPU (Triton under its interpreter, a small
architecture), which is how the script itself is tested without a GPU:

    python scripts/gpu_check.py --device cpu --arch smollm2-135m --quick --out /tmp/r.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "The mitochondria is",
    "Translate to French: good morning",
    "2 + 2 =",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, runs: int) -> float:
    """Fastest of `runs` timed calls (after one warm-up), synchronized on the device."""
    fn()
    sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def part_device(
    device: torch.device, dtype: torch.dtype, quick: bool, limits: dict[str, float]
) -> list[str]:
    """The device, its software, and its measured matmul and read limits (into `limits`)."""
    lines = [f"- torch {torch.__version__}, device {device}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(
            f"- {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
            f"{props.major}.{props.minor}, CUDA {torch.version.cuda}"
        )
    for module in ("triton", "flash_attn"):
        try:
            mod = __import__(module)
            lines.append(f"- {module} {getattr(mod, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001 (any import failure is the finding)
            lines.append(f"- {module}: does not import ({type(e).__name__}: {e})")
    n = 2048 if quick or device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / best_time(lambda: a @ b, device, 3 if quick else 10)
    buf = torch.ones(1 << (26 if quick else 28), device=device, dtype=torch.float32)
    bandwidth = buf.numel() * 4 / best_time(lambda: buf.sum(), device, 3 if quick else 10)
    lines.append(
        f"- measured: {dtype} matmul {flops / 1e12:.1f} TFLOP/s ({n}^3), read "
        f"{bandwidth / 1e9:.0f} GB/s"
    )
    limits.update(flops=flops, bandwidth=bandwidth)
    return lines


def random_batch(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[tuple[torch.Tensor, ...], object]:
    """A hybrid batch (q, k, v, k_cache, v_cache) and its metadata; seqs = [(q_len,
    k_len)], each sequence's earlier keys already in scattered cache blocks."""
    from sarazmq.kernels.metadata import AttentionMetadata
    from sarazmq.kernels.torch_attention import write_kv_cache

    g = torch.Generator().manual_seed(0)
    h, hkv = heads
    per_seq = [-(-k // block_size) for _, k in seqs]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in per_seq:
        tables.append(perm[:n])
        perm = perm[n:]
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    ctx_lens = [k - q for q, k in seqs]
    ctx = AttentionMetadata.build(ctx_lens, ctx_lens, tables, block_size, device=device)
    if ctx.num_tokens:
        ck = torch.randn(ctx.num_tokens, hkv, head_dim, generator=g).to(dtype).to(device)
        write_kv_cache(ck, ck.flip(0), k_cache, v_cache, ctx.slot_mapping)
    q_lens, k_lens = [q for q, _ in seqs], [k for _, k in seqs]
    meta = AttentionMetadata.build(q_lens, k_lens, tables, block_size, device=device)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, n, head_dim, generator=g).to(dtype).to(device) for n in (h, hkv, hkv))
    return (q, k, v, k_cache, v_cache), meta


def part_kernels(device: torch.device, quick: bool) -> list[str]:
    """Triton (and flash-attn) attention against the torch reference on the device."""
    from sarazmq.kernels import triton_attention as ta
    from sarazmq.kernels.torch_attention import TorchPagedAttention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    atol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    small = quick or device.type == "cpu"
    cases = [
        ("decodes", [(1, 17), (1, 300), (1, 1)]),
        ("hybrid", [(1, 40), (1, 513), (37, 37), (64, 200)]),
        ("long chunk", [(128 if small else 512, 300 if small else 2048)]),
    ]
    heads = [(8, 2)] if small else [(32, 8), (32, 32)]
    lines = ["| case | heads (q, kv) | block | max abs error | within " + f"{atol:g} |"]
    lines.append("|---|---|---|---|---|")
    for name, seqs in cases:
        for hq in heads:
            for block in (16,) if small else (16, 32):
                (q, k, v, kc, vc), meta = random_batch(seqs, hq, 64, block, dtype, device)
                ref_k, ref_v = kc.clone(), vc.clone()
                ref = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, 0.125)
                ta.write_kv_cache(k, v, kc, vc, meta.slot_mapping)
                out = ta.paged_attention(q, kc, vc, meta, 0.125)
                err = (out.float() - ref.float()).abs().max().item()
                same_cache = torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
                ok = err <= atol and same_cache
                lines.append(f"| triton {name} | {hq} | {block} | {err:.2e} | {ok} |")
    return lines


def part_exactness(device: torch.device, max_tokens: int) -> list[str]:
    """Greedy float32 tokens on the device against the CPU float32 path (on a CPU run:
    the CPU kernels against the torch attention backend)."""
    from sarazmq import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = [(device.type, "auto"), ("cpu", "auto" if device.type == "cuda" else "torch")]
    tokens, names = [], []
    layers = ""
    for dev, backend in runs:
        # float: the CPU reference must not take the int8 GGUF matmuls (issue 38)
        llm = LLM(
            dtype="float32",
            device=dev,
            attention_backend=backend,
            num_kv_blocks=256,
            gguf_matmul="float",
        )
        tokens.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        names.append(f"{dev} ({llm.engine.runner.model.attention.name} attention)")
        layers = f"{llm.engine.runner.model.config.num_layers} layers"
        del llm
    pairs = list(zip(*tokens))
    same = sum(a == b for a, b in pairs)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    return [
        f"- the default model ({layers}), {names[0]} against {names[1]}: {same} of {len(PROMPTS)} prompts give the same "
        f"{max_tokens} greedy tokens; tokens equal before the first difference: {prefix}",
    ]


def part_speed(device: torch.device, arch: str, limits: dict[str, float], quick: bool) -> list[str]:
    """Prefill and decode of a random-weight model of `arch` against its rooflines."""
    from engine_bench.common import DECODE_CTX, PREFILL_CHUNK, PROMPT_LEN
    from engine_bench.cost import model_cost
    from engine_bench.runner_bench import RunnerBench

    from sarazmq import LLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = (1, 16) if quick else (1, 16, 64)
    blocks = max(batches) * -(-DECODE_CTX // 16) + -(-PROMPT_LEN // 16) + 64
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
    rows = ["| shape | measured | limit | of limit |", "|---|---|---|---|"]
    chunks = list(range(0, PROMPT_LEN, PREFILL_CHUNK))
    flops = sum(
        cost.flops([PREFILL_CHUNK], [s + PREFILL_CHUNK], 1 if s == chunks[-1] else 0)
        for s in chunks
    )
    t = bench.prefill(PREFILL_CHUNK, runs)
    limit = flops / limits["flops"]
    rows.append(
        f"| prefill {PROMPT_LEN} in {PREFILL_CHUNK}-token chunks | {PROMPT_LEN / t:,.0f} tok/s "
        f"| {PROMPT_LEN / limit:,.0f} tok/s | {limit / t:.2f} |"
    )
    for b in batches:
        t = bench.decode(b, runs)
        k_lens = [DECODE_CTX] * b
        limit = max(cost.flops([1] * b, k_lens, b) / limits["flops"],
                    cost.bytes(k_lens) / limits["bandwidth"])  # fmt: skip
        rows.append(
            f"| decode, {b} running at {DECODE_CTX} tokens | {b / t:,.0f} tok/s | "
            f"{b / limit:,.0f} tok/s | {limit / t:.2f} |"
        )
    return [f"{arch}, random weights, {dtype}, "
            f"attention {llm.engine.runner.model.attention.name}:", "", *rows]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--arch", default="llama-3-8b", help="architecture of the speed part")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", default="gpu_check_report.md")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch sees none); --device cpu checks the script")
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = [f"# gpu_check report ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    limits: dict[str, float] = {"flops": float("nan"), "bandwidth": float("nan")}
    parts: list[tuple[str, Callable[[], list[str]]]] = [
        ("Device and limits", lambda: part_device(device, dtype, args.quick, limits)),
        ("Attention kernels against the torch reference", lambda: part_kernels(device, args.quick)),
        ("Exactness against the CPU float32 path", lambda: part_exactness(device, args.tokens)),
        ("Speed at real shapes", lambda: part_speed(device, args.arch, limits, args.quick)),
    ]
    failed = 0
    for title, run in parts:
        t0 = time.perf_counter()
        print(f"gpu_check: {title} ...", flush=True)
        try:
            lines = run()
        except Exception:  # noqa: BLE001 (a part's failure is reported, the next one runs)
            failed += 1
            lines = ["FAILED:", "```", traceback.format_exc().rstrip(), "```"]
        report += [f"## {title} ({time.perf_counter() - t0:.0f} s)", "", *lines, ""]
        Path(args.out).write_text("\n".join(report))  # what is done survives a timeout
        print("\n".join(lines), flush=True)
    print(f"gpu_check: report in {args.out}; {failed} part(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
