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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import part_speed  # noqa: E402

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


def cpu_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch backend's attention in float32 on the CPU of copies of these inputs: (out,
    k_cache, v_cache after the write). On the host, so that no device kernel can fail the
    reference (cuDNN's attention did on an H200) and its precision exceeds the device's."""
    from sarazmq.kernels.metadata import AttentionMetadata
    from sarazmq.kernels.torch_attention import TorchPagedAttention

    tables = [
        row[: -(-k_len // k_cache.shape[1])]
        for row, k_len in zip(meta.block_tables.cpu().tolist(), meta.k_lens)
    ]
    host = AttentionMetadata.build(meta.q_lens, meta.k_lens, tables, k_cache.shape[1])
    ref_k, ref_v = k_cache.float().cpu(), v_cache.float().cpu()
    f32 = [x.float().cpu() for x in (q, k, v)]
    out = TorchPagedAttention().forward(*f32, ref_k, ref_v, host, scale)
    return out, ref_k, ref_v


def part_kernels(device: torch.device, quick: bool) -> list[str]:
    """Triton (and flash-attn) attention against the torch reference on the device."""
    from sarazmq.kernels import triton_attention as ta

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
                ref, ref_k, ref_v = cpu_reference(q, k, v, kc, vc, meta, 0.125)
                ta.write_kv_cache(k, v, kc, vc, meta.slot_mapping)
                out = ta.paged_attention(q, kc, vc, meta, 0.125)
                err = (out.float().cpu() - ref).abs().max().item()
                same_cache = torch.equal(kc.float().cpu(), ref_k) and torch.equal(
                    vc.float().cpu(), ref_v
                )
                ok = err <= atol and same_cache
                lines.append(f"| triton {name} | {hq} | {block} | {err:.2e} | {ok} |")
    return lines + ["", *elementwise_ops(device, dtype, small)]


def elementwise_ops(device: torch.device, dtype: torch.dtype, small: bool) -> list[str]:
    """The Triton backend's RMSNorm, RoPE and SiLU-and-multiply against torch's ops on the
    device, at a Llama-3-8B layer's shapes (64 tokens): largest difference and the share of
    elements that differ at all (rounding: a last-bit difference now and then)."""
    from sarazmq.kernels.cpu_ops import TORCH_OPS
    from sarazmq.kernels.ops import build_rope_cache, rope_cos_sin
    from sarazmq.kernels.triton_ops import TRITON_OPS

    g = torch.Generator().manual_seed(1)
    t, hidden, heads, d, inter = (8, 256, 10, 64, 300) if small else (64, 4096, 40, 128, 14336)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    x, res, w = rand(t, hidden), rand(t, hidden), rand(hidden)
    qk, gate_up = rand(t, heads, d), rand(t, 2 * inter)
    cache = build_rope_cache(d, 4096, 500000.0, None, device)
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (t,), generator=g).to(device), cache, dtype)
    pairs = {
        "rms_norm + residual": (
            torch.cat(TRITON_OPS.rms_norm_(x, w, 1e-5, res.clone())),
            torch.cat(TORCH_OPS.rms_norm_(x, w, 1e-5, res.clone())),
        ),
        "rope (q and k heads)": (
            TRITON_OPS.apply_rope_(qk.clone(), cos, sin),
            TORCH_OPS.apply_rope_(qk.clone(), cos, sin),
        ),
        "silu_mul": (TRITON_OPS.silu_mul(gate_up, inter), TORCH_OPS.silu_mul(gate_up, inter)),
    }
    lines = ["| triton op against torch's | max abs difference | elements that differ |"]
    lines.append("|---|---|---|")
    for name, (got, ref) in pairs.items():
        diff = (got.float() - ref.float()).abs()
        lines.append(
            f"| {name} | {diff.max().item():.2e} | {(diff > 0).float().mean().item():.2%} |"
        )
    return lines


def part_torch_backend(device: torch.device) -> list[str]:
    """The torch backend (`--attention-backend torch`) on the device against the float32
    CPU reference: the SDPA kernels it lets run on CUDA (cuDNN's are excluded)."""
    from sarazmq.kernels.torch_attention import TorchPagedAttention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seqs = [(1, 40), (1, 513), (37, 37), (64, 200)]
    (q, k, v, kc, vc), meta = random_batch(seqs, (32, 8), 128, 16, dtype, device)
    ref, _, _ = cpu_reference(q, k, v, kc, vc, meta, 0.125)
    out = TorchPagedAttention().forward(q, k, v, kc, vc, meta, 0.125)
    err = (out.float().cpu() - ref).abs().max().item()
    return [f"- a hybrid batch, heads (32, 8), head size 128: max abs error {err:.2e}"]


def part_exactness(device: torch.device, max_tokens: int) -> list[str]:
    """Greedy float32 tokens and their logprobs on the device (decodes replayed from CUDA
    graphs) against the CPU float32 path, and against the device op by op
    (`enforce_eager`); on a CPU run: the CPU kernels against the torch backend."""
    from sarazmq import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    if device.type == "cuda":
        runs = [("cuda", "auto", False), ("cpu", "auto", False), ("cuda", "auto", True)]
    else:
        runs = [("cpu", "auto", False), ("cpu", "torch", False)]
    results, names = [], []
    layers = ""
    for dev, backend, eager in runs:
        # float: the CPU reference must not take the int8 GGUF matmuls (issue 38)
        llm = LLM(
            dtype="float32",
            device=dev,
            attention_backend=backend,
            enforce_eager=eager,
            num_kv_blocks=256,
            gguf_matmul="float",
        )
        outs = llm.generate(PROMPTS, params)
        results.append([(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs])
        runner = llm.engine.runner
        graphs = "" if runner.decode_graphs is None else ", CUDA graphs"
        names.append(f"{dev} ({runner.model.attention.name} attention{graphs})")
        layers = f"{runner.model.config.num_layers} layers"
        del llm
    lines = []
    for other in range(1, len(runs)):
        pairs = list(zip(results[0], results[other]))
        same = sum(a[0] == b[0] for a, b in pairs)
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), len(a[0]))
            for a, b in pairs
        ]
        # logprobs of the tokens both chose, up to the first difference
        diffs = [
            abs(x - y)
            for ((_, la), (_, lb)), n in zip(pairs, prefix)
            for x, y in zip(la[:n], lb[:n])
        ]
        lines.append(
            f"- the default model ({layers}), {names[0]} against {names[other]}: {same} of "
            f"{len(PROMPTS)} prompts give the same {max_tokens} greedy tokens; tokens equal "
            f"before the first difference: {prefix}; largest logprob difference "
            f"{max(diffs, default=float('nan')):.2e}"
        )
    return lines


#: the report's parts, in order (`--parts`)
PARTS = ("device", "kernels", "exactness", "speed", "torch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--arch", default="llama-3-8b", help="architecture of the speed part")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", default="gpu_check_report.md")
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {','.join(PARTS)},host (host: where an "
        "op-by-op step's host time goes, with the speed part)",
    )
    args = ap.parse_args()
    wanted = set(args.parts.split(","))
    if not wanted <= {*PARTS, "host"}:
        ap.error(f"--parts: unknown part(s) {sorted(wanted - {*PARTS, 'host'})}")
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
        (
            "Speed at real shapes",
            lambda: part_speed(device, args.arch, limits, args.quick, "host" in wanted),
        ),
        # last: a device error here (as cuDNN's attention raised once) costs no other part
        ("The torch backend on the device", lambda: part_torch_backend(device)),
    ]
    parts = [part for name, part in zip(PARTS, parts, strict=True) if name in wanted]
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
