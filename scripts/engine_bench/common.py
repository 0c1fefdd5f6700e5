"""Shapes, timing and machine limits shared by the engine benchmark's parts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

PROMPT_LEN = 2048
PREFILL_CHUNK = 512
DECODE_CTX = 512
DECODE_BATCHES = (1, 16, 64)
# decode batches for the fused-step A/B, those the model's fused step takes (up to 8
# sequences in bf16, 6 in float32; 16 and 32 where the model reads a GGUF's blocks)
EAGER_AB_BATCHES = (1, 4, 8, 16, 32)
HYBRID_CHUNK = 256
HYBRID_DECODES = 32


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_machine(dtype: torch.dtype, quick: bool) -> tuple[float, float]:
    """(GEMM peak FLOP/s in `dtype`, memory read bandwidth bytes/s), best of a few tries."""
    n = 1024 if quick else 2048
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = min(time_once(lambda: a @ b) for _ in range(3))
    peak = 2 * n**3 / best
    buf = torch.ones(128 * 1024 * 1024)  # 512 MB of float32, far beyond any cache
    buf.sum()
    best = min(time_once(buf.sum) for _ in range(3))
    bandwidth = buf.numel() * 4 / best
    del buf
    return peak, bandwidth


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
