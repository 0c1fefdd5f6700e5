"""Microbenchmark: the int8 block matmul (kernels/int8_dot.py) against the float32 paths.

For the default model's matmul shapes (SmolLM2-135M: qkv 576 -> 960, o 576 -> 576,
gate_up 576 -> 3072, down 1536 -> 576) and M rows, prints the milliseconds of

- f32: torch.matmul on the dequantized float32 weight (same thread count);
- bq: the existing block_quant kernel (dequantizes blocks to float32 in registers; it
  takes up to 64 rows);
- int8: the int8 path, activation quantization included (q: the quantizer alone);

with the int8 path's GOP/s (2 M N K / time), its speed over f32 (f32 ms / int8 ms), and
its fraction of the int8 limit (the peak probe: a tight VPMADDUBSW + VPMADDWD + VPADDD
loop, 32 int8 MACs per round, no per-block scaling) beside f32's fraction of the float32
FMA probe (a tight VFMADD231PS loop).

    OMP_NUM_THREADS=1 python scripts/bench_int8_dot.py --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from functools import partial

import torch

from sarazmq.kernels.block_quant import BlockQuantWeight, block_quant_linear
from sarazmq.kernels.int8_dot import int8_block_linear, int8_dot_avx2, quantize_activations
from sarazmq.kernels.native import load_library

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 16, 64, 512, 2048)


def best_time(fn: Callable[[], object], min_s: float = 0.15) -> float:
    """Best seconds per call over repeated calls for about min_s seconds (after a warmup)."""
    fn()
    best = float("inf")
    end = time.perf_counter() + min_s
    runs = 0
    while runs < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return best


def peak_macs(int8: bool) -> float:
    """MAC/s of the C probe loop (int8 dot-accumulate or float32 FMA), all threads."""
    lib = load_library()
    assert lib is not None
    fn = lib.int8_peak_probe
    fn.argtypes = [ctypes.c_long, ctypes.c_int]
    fn.restype = ctypes.c_long
    iters = 2_000_000
    fn(iters // 10, int(int8))
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        macs = fn(iters, int(int8))
        best = max(best, macs / (time.perf_counter() - t))
    return best


def make_weight(n: int, k: int, kind: str, g: torch.Generator) -> BlockQuantWeight:
    """A random Q4_0-style (m = -8 d) or Q8_0 weight [n, k]."""
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    if kind == "q4":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        return BlockQuantWeight("q4", qs, torch.stack([d, -8 * d], dim=-1).contiguous())
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return BlockQuantWeight("q8", qs, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kind", choices=("q4", "q8"), default="q4")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    int8_peak, f32_peak = peak_macs(True), peak_macs(False)
    print(
        f"threads {args.threads}, weights {args.kind}, AVX2 int8 kernel {int8_dot_avx2()}; "
        f"int8 probe {2 * int8_peak / 1e9:,.0f} GOP/s, f32 FMA probe "
        f"{2 * f32_peak / 1e9:,.0f} GFLOP/s"
    )
    head = (
        f"{'matmul':8} {'M':>5} {'f32 ms':>8} {'bq ms':>8} {'int8 ms':>8} {'q ms':>7} "
        f"{'int8 GOP/s':>10} {'f32 GF/s':>9} {'speedup':>7} {'int8/lim':>8} {'f32/lim':>8}"
    )
    print(head)
    print("-" * len(head))
    for name, (n, k) in SHAPES.items():
        w = make_weight(n, k, args.kind, g)
        wf = w.dequantize()  # [N, K]
        wt = wf.T  # as F.linear / torch.matmul read it
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            t_f = best_time(partial(torch.matmul, x, wt))
            t_bq = best_time(partial(block_quant_linear, x, w)) if m <= 64 else float("nan")
            t_i = best_time(partial(int8_block_linear, x, w))
            t_q = best_time(partial(quantize_activations, x))
            ops = 2.0 * m * n * k
            print(
                f"{name:8} {m:>5} {t_f * 1e3:>8.3f} {t_bq * 1e3:>8.3f} {t_i * 1e3:>8.3f} "
                f"{t_q * 1e3:>7.3f} {ops / t_i / 1e9:>10.1f} {ops / t_f / 1e9:>9.1f} "
                f"{t_f / t_i:>7.2f} {ops / t_i / (2 * int8_peak):>8.2f} "
                f"{ops / t_f / (2 * f32_peak):>8.2f}"
            )


if __name__ == "__main__":
    main()
