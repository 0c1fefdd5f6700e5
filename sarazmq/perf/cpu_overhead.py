"""The CPU's share of an iteration (scheduling, input preparation, sampling, output
processing), from Vidur's measured vLLM overheads on an A100 host (cpu_overheads.csv).

`cpu_overhead_s(num_seqs)` is the whole of it per iteration; `cpu_overhead_split_s` splits
it into the work before the forward pass and after it (a pipeline's first and last
stage).
"""

from __future__ import annotations

import bisect
import csv
import functools
from collections.abc import Sequence

from sarazmq.perf.profiles import profiles_root

VIDUR_CPU = "a100/cpu_overheads.csv"
#: the CPU-side parts of an iteration in cpu_overheads.csv (model_execution_e2e waits on
#: the GPU, which the other terms model)
CPU_PARTS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")
#: the CPU_PARTS that come before the forward pass (the rest, sampling and output
#: processing, come after it): where a pipeline charges them (its first / last stage)
CPU_PRE_PARTS = ("schedule", "prepare_inputs_e2e")
#: the pre share of the CPU time when cpu_overheads.csv is absent
DEFAULT_CPU_PRE_FRACTION = 0.5
#: per iteration when cpu_overheads.csv is absent: its Llama-2-7B value at batch 32
DEFAULT_CPU_OVERHEAD_S = 2.1e-3


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in x; clamped below the first point, extrapolated past the last."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        i -= 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@functools.cache
def _cpu_rows() -> dict[int, list[tuple[float, float]]] | None:
    """{batch size: [(seconds of CPU_PARTS, seconds of CPU_PRE_PARTS), ...]} of Vidur's
    Llama-2-7B rows in cpu_overheads.csv, or None where the file is absent."""
    path = profiles_root() / "data" / "profiling" / VIDUR_CPU
    if not path.is_file():
        return None
    by_bs: dict[int, list[tuple[float, float]]] = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["model_name"] == "meta-llama/Llama-2-7b-hf":
                s = sum(float(row[f"{p}_median"]) for p in CPU_PARTS) * 1e-3
                pre = sum(float(row[f"{p}_median"]) for p in CPU_PRE_PARTS) * 1e-3
                by_bs.setdefault(int(row["batch_size"]), []).append((s, pre))
    return by_bs


@functools.cache
def cpu_overhead_table() -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(batch sizes, seconds per iteration of CPU_PARTS) of Vidur's Llama-2-7B TP1 rows in
    cpu_overheads.csv (vLLM on an A100 host), or None where the file is absent."""
    by_bs = _cpu_rows()
    if by_bs is None:
        return None
    bs = sorted(by_bs)
    return tuple(float(b) for b in bs), tuple(
        sum(v[0] for v in by_bs[b]) / len(by_bs[b]) for b in bs
    )


@functools.cache
def cpu_pre_fraction_table() -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(batch sizes, share of the CPU time spent before the forward pass: CPU_PRE_PARTS
    over CPU_PARTS) from the same rows, or None where the file is absent."""
    by_bs = _cpu_rows()
    if by_bs is None:
        return None
    bs = sorted(by_bs)
    fracs = tuple(sum(v[1] for v in by_bs[b]) / sum(v[0] for v in by_bs[b]) for b in bs)
    return tuple(float(b) for b in bs), fracs


def cpu_overhead_s(num_seqs: int) -> float:
    """The CPU's per-iteration time (scheduling, input preparation, sampling, output
    processing) at this batch size: Vidur's Llama-2-7B table, clamped to its 8..128 range
    (1.2 ms at 8, 6.2 ms at 128), else DEFAULT_CPU_OVERHEAD_S."""
    table = cpu_overhead_table()
    if table is None:
        return DEFAULT_CPU_OVERHEAD_S
    bs, secs = table
    return secs[-1] if num_seqs >= bs[-1] else interp(bs, secs, num_seqs)


def cpu_overhead_split_s(num_seqs: int) -> tuple[float, float]:
    """`cpu_overhead_s(num_seqs)` split into (before the forward pass: scheduling and
    input preparation; after it: sampling and output processing), by the shares Vidur's
    table measured at this batch size (clamped as there; half and half without it)."""
    total = cpu_overhead_s(num_seqs)
    table = cpu_pre_fraction_table()
    if table is None:
        frac = DEFAULT_CPU_PRE_FRACTION
    else:
        bs, fracs = table
        frac = fracs[-1] if num_seqs >= bs[-1] else interp(bs, fracs, num_seqs)
    pre = total * frac
    return pre, total - pre
