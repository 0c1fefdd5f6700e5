"""A quick probe of this machine's limits: GEMM FLOP/s and memory read bandwidth.

MFU and MBU are measured against these; a sweep probes at its start and end and flags
points run while the machine's limits moved (other load on a shared machine)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MachineProbe:
    """gemm_flops: an n x n x n matmul's FLOP/s in `dtype`, best of a few tries.
    bandwidth_bytes_s: a 512 MB float32 sum's read bytes/s, best of a few tries.
    """

    gemm_flops: float
    bandwidth_bytes_s: float
    dtype: str
    gemm_size: int
    cpu_model: str
    threads: int
    cpus: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"GEMM {self.gemm_flops / 1e9:,.0f} GFLOP/s ({self.dtype}), read bandwidth "
            f"{self.bandwidth_bytes_s / 1e9:,.1f} GB/s, {self.threads} threads on {self.cpu_model}"
        )


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median seconds of `runs` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn) for _ in range(runs))


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_machine(dtype: torch.dtype = torch.float32, quick: bool = False) -> MachineProbe:
    """Measures the GEMM peak in `dtype` (n = 1024 quick, else 2048) and the read bandwidth."""
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
    return MachineProbe(
        gemm_flops=peak,
        bandwidth_bytes_s=bandwidth,
        dtype=str(dtype).removeprefix("torch."),
        gemm_size=n,
        cpu_model=cpu_model(),
        threads=torch.get_num_threads(),
        cpus=os.cpu_count() or 1,
    )
