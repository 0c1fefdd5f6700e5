"""Microbenchmark: the int8 block matmul (kernels/int8_dot.py) against the float32 paths.

For the default model's matmul shapes (SmolLM2-135M: qkv 576 -> 960, o 576 -> 576,
gate_up 576 -> 3072, down 1536 -> 576) and M rows, prints the milliseconds of

- f32: torch.matmul on the dequantized float32 weight (same thread count);
- bq: the existing block_quant kernel (dequantizes blocks to float32 in registers; it
  takes up to 64 rows);
- int8: the int8 kernel on the blocks' own layout (int8_dot.c), activation quantization
  included (q: the quantizer alone);
- panel: the int8 kernel on panels of 16 interleaved columns (int8_panels.c, what the
  model uses for Q4 weights, and for Q8 ones where VPDPBUSD is built), quantization
  included;

with the faster int8 path's GOP/s (2 M N K / time), each int8 path's speed over f32
(f32 ms / its ms), and the faster one's fraction of the int8 limit (the peak probe: tight
chains of VPMADDUBSW summed by VPADDW, or of VPDPBUSD on VNNI CPUs, on the panels' vector
width, 32 or 64 int8 MACs each, no per-block scaling) beside f32's fraction of the float32 FMA probe (a tight 256-bit
VFMADD231PS loop: torch's AVX-512 GEMMs can pass 1.0 of it).

    OMP_NUM_THREADS=1 python scripts/bench_int8_dot.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from sarazmq.kernels.block_quant import BlockQuantWeight, block_quant_linear
from sarazmq.kernels.int8_dot import (
    int8_block_linear,
    int8_dot_avx2,
    int8_dot_vnni,
    int8_panels_linear,
    int8_panels_take,
    int8_panels_vector_bits,
    pack_int8_panels,
    probe_peak_macs,
    quantize_activations,
)

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
    ap.add_argument("--lm-head", action="store_true", help="also the LM head (49152 x 576)")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    int8_peak, f32_peak = probe_peak_macs(True), probe_peak_macs(False)
    print(
        f"threads {args.threads}, weights {args.kind}, AVX2 int8 kernel {int8_dot_avx2()} "
        f"(VPDPBUSD {int8_dot_vnni()}, panels {int8_panels_vector_bits()}-bit); "
        f"int8 probe {2 * int8_peak / 1e9:,.0f} GOP/s, f32 FMA probe "
        f"{2 * f32_peak / 1e9:,.0f} GFLOP/s"
    )
    head = (
        f"{'matmul':8} {'M':>5} {'f32 ms':>8} {'bq ms':>8} {'int8 ms':>8} {'panel ms':>8} "
        f"{'q ms':>7} {'GOP/s':>7} {'f32 GF/s':>9} {'int8 x':>6} {'panel x':>7} "
        f"{'p/lim':>6} {'f32/lim':>7}"
    )
    print(head)
    print("-" * len(head))
    shapes = {**SHAPES, "lm_head": (49152, 576)} if args.lm_head else SHAPES
    for name, (n, k) in shapes.items():
        w = make_weight(n, k, args.kind, g)
        wf = w.dequantize()  # [N, K]
        wt = wf.T  # as F.linear / torch.matmul read it
        panels = pack_int8_panels(w) if int8_panels_take(args.kind) else None
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            t_f = best_time(partial(torch.matmul, x, wt))
            t_bq = best_time(partial(block_quant_linear, x, w)) if m <= 64 else float("nan")
            t_i = best_time(partial(int8_block_linear, x, w))
            t_p = best_time(partial(int8_panels_linear, x, panels)) if panels else float("nan")
            t_q = best_time(partial(quantize_activations, x))
            ops = 2.0 * m * n * k
            t_best = min(t_i, t_p) if panels else t_i
            print(
                f"{name:8} {m:>5} {t_f * 1e3:>8.3f} {t_bq * 1e3:>8.3f} {t_i * 1e3:>8.3f} "
                f"{t_p * 1e3:>8.3f} {t_q * 1e3:>7.3f} {ops / t_best / 1e9:>7.1f} "
                f"{ops / t_f / 1e9:>9.1f} {t_f / t_i:>6.2f} {t_f / t_p:>7.2f} "
                f"{ops / t_best / (2 * int8_peak):>6.2f} {ops / t_f / (2 * f32_peak):>7.2f}"
            )


if __name__ == "__main__":
    main()
