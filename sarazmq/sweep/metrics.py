"""A sweep point's row: one flat dict of the metrics the curves are drawn from.

On top of replay's `summarize` (same definitions: TTFT, pooled TBT, TPOT, decode stall =
a request's longest TBT, goodput), a row has
- P95s, computed here from the per-request metrics (replay's summary stops at P90/P99);
- stall_total_s: the sum of every TBT gap longer than STALL_FACTOR x the point's median
  TBT (the whole gap counts), and stall_count: how many such gaps;
- busy_fraction: the summed iteration durations over the makespan (first arrival ->
  last token);
- mfu / mbu: per-iteration FLOPs / duration / machine GEMM FLOP/s and bytes / duration /
  machine bandwidth, averaged over iterations weighted by duration, which is
  sum(FLOPs) / (peak x sum(durations)) (and the same for bytes). None without a cost
  model or machine limits. The row keeps busy_s, iteration_flops and iteration_bytes so
  that MFU/MBU can be recomputed against other limits (`utilization_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from sarazmq.replay.metrics import IterationSample, RequestRecord, request_metrics, summarize
from sarazmq.scheduler import IterationShape

#: A TBT gap longer than this many times the point's median TBT is a stall.
STALL_FACTOR = 2.0


class IterationCost(Protocol):
    """FLOPs and bytes moved by one iteration (`sarazmq.perf.cost.ModelCost`)."""

    def flops(self, shape: IterationShape) -> float: ...

    def bytes(self, shape: IterationShape) -> float: ...


def stall_total(tbts_s: Sequence[float], factor: float = STALL_FACTOR) -> tuple[float, int]:
    """(sum of the gaps longer than factor x median gap, their number); (0, 0) if none."""
    arr = np.asarray(tbts_s, dtype=np.float64)
    if arr.size == 0:
        return 0.0, 0
    over = arr[arr > factor * float(np.median(arr))]
    return float(over.sum()), int(over.size)


def busy_fraction(iterations: Sequence[IterationSample], makespan_s: float) -> float | None:
    """Summed iteration durations / makespan (None for an empty makespan)."""
    if makespan_s <= 0:
        return None
    return float(sum(it.duration_s for it in iterations)) / makespan_s


def utilization(
    iterations: Sequence[IterationSample],
    cost: IterationCost | None,
    peak_flops: float | None,
    bandwidth: float | None,
) -> tuple[float | None, float | None]:
    """(MFU, MBU) over the iterations, duration-weighted (see the module docstring)."""
    busy = float(sum(it.duration_s for it in iterations))
    if cost is None or busy <= 0:
        return None, None
    shapes = [it.shape() for it in iterations]
    mfu = mbu = None
    if peak_flops:
        mfu = float(sum(cost.flops(s) for s in shapes)) / (peak_flops * busy)
    if bandwidth:
        mbu = float(sum(cost.bytes(s) for s in shapes)) / (bandwidth * busy)
    return mfu, mbu


def utilization_of(
    row: Mapping[str, Any], peak_flops: float | None, bandwidth: float | None
) -> tuple[float | None, float | None]:
    """(MFU, MBU) of a row from its busy_s, iteration_flops and iteration_bytes."""
    busy, flops, nbytes = (
        row_value(row, k) for k in ("busy_s", "iteration_flops", "iteration_bytes")
    )
    if not busy:
        return None, None
    mfu = flops / (peak_flops * busy) if flops is not None and peak_flops else None
    mbu = nbytes / (bandwidth * busy) if nbytes is not None and bandwidth else None
    return mfu, mbu


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def point_row(
    records: Sequence[RequestRecord],
    iterations: Sequence[IterationSample],
    *,
    slo_ttft: float | None = None,
    slo_tbt: float | None = None,
    cost: IterationCost | None = None,
    peak_flops: float | None = None,
    bandwidth: float | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(row, summary): the point's flat metrics row and replay's full summary."""
    summary = summarize(records, iterations, slo_ttft, slo_tbt)
    per_req = [request_metrics(r) for r in records if r.ok]
    tbts = [g for m in per_req for g in m.tbts_s]
    ttfts = [m.ttft_s for m in per_req if m.ttft_s is not None]
    stalls = [m.decode_stall_s for m in per_req if m.decode_stall_s is not None]
    tpots = [m.tpot_s for m in per_req if m.tpot_s is not None]
    makespan = float(summary["makespan_s"])
    total_tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in records if r.ok)
    stall_s, stall_n = stall_total(tbts)
    mfu, mbu = utilization(iterations, cost, peak_flops, bandwidth)
    busy_s = float(sum(it.duration_s for it in iterations))
    shapes = [it.shape() for it in iterations] if cost is not None else []
    thr = summary["throughput"]
    good = summary["goodput"]
    row: dict[str, Any] = {
        "num_requests": summary["num_requests"],
        "num_completed": summary["num_completed"],
        "num_errors": summary["num_errors"],
        "makespan_s": makespan,
        "output_tokens_per_s": thr["output_tokens_per_s"],
        "total_tokens_per_s": total_tokens / makespan if makespan > 0 else None,
        "requests_per_s": thr["requests_per_s"],
        **{f"ttft_p{q}_s": _pct(ttfts, q) for q in (50, 95, 99)},
        **{f"tbt_p{q}_s": _pct(tbts, q) for q in (50, 95, 99)},
        "tpot_p50_s": _pct(tpots, 50),
        "decode_stall_p99_s": _pct(stalls, 99),
        "stall_total_s": stall_s,
        "stall_count": stall_n,
        "busy_fraction": busy_fraction(iterations, makespan),
        "mfu": mfu,
        "mbu": mbu,
        "busy_s": busy_s,
        "iteration_flops": float(sum(cost.flops(x) for x in shapes)) if cost else None,
        "iteration_bytes": float(sum(cost.bytes(x) for x in shapes)) if cost else None,
        "num_iterations": len(iterations),
        "preemptions": summary["total_preemptions"],
        "slo_attainment": good["fraction"],
        "goodput_rps": good["requests_per_s"],
    }
    return row, summary


def row_value(row: Mapping[str, Any], name: str) -> float | None:
    """A numeric metric of a row (None when missing or not a number)."""
    v = row.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
