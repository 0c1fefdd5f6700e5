"""Capacity search: the highest arrival rate a deployment serves within latency SLOs.

Sarathi-Serve's definition of capacity is the highest request rate at which the P99
time-between-tokens stays within an SLO and the median scheduling delay stays within
another (an overloaded server's queue grows without bound, which shows first in the
scheduling delay). `find_capacity` finds it by a bounded search over a callable that
replays the workload at a given rate and returns `metrics.summarize`'s dict:

1. probe lo_qps; if it already fails the SLOs the capacity is below the search range;
2. probe hi_qps and, while it passes, multiply it by `growth` (capped at `max_qps`);
3. bisect between the highest passing and lowest failing rates until they are within
   `rel_tol` of each other.

Every call to the callable counts against `max_iters`, and every probe is recorded.
Bisection assumes that passing is monotone in the rate; measurements are noisy, so the
probes are returned for the reader to judge.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

STOP_REASONS = ("converged", "max_iters", "cap", "lo_fails")

CAPACITY_JSON = "capacity.json"
CAPACITY_TXT = "capacity.txt"


@dataclass(frozen=True)
class CapacityProbe:
    """One replay at `qps` and whether it met the SLOs (reason says why not)."""

    qps: float
    tbt_p99_s: float | None
    sched_delay_p50_s: float | None
    num_errors: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class CapacityResult:
    """Outcome of `find_capacity`.

    capacity_qps: highest probed rate that met the SLOs (None if even lo_qps failed).
    lowest_failing_qps: lowest probed rate that failed (None if none failed).
    stop_reason: "converged" (bracket within rel_tol), "max_iters" (ran out of probes),
        "cap" (max_qps itself passed) or "lo_fails" (lo_qps failed).
    probes: every probe in the order it ran.
    """

    capacity_qps: float | None
    lowest_failing_qps: float | None
    stop_reason: str
    slo_tbt_p99_s: float
    slo_sched_delay_p50_s: float
    probes: tuple[CapacityProbe, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def judge(
    qps: float, summary: Mapping[str, Any], slo_tbt_p99: float, slo_sched_delay_p50: float
) -> CapacityProbe:
    """Whether one run's summary meets the SLOs. A run with errors, with no completed
    request, or missing TBT or scheduling-delay samples fails (it proves nothing)."""
    tbt = (summary.get("tbt_s") or {}).get("p99")
    sched = (summary.get("scheduling_delay_s") or {}).get("p50")
    errors = int(summary.get("num_errors", 0) or 0)
    reasons = []
    if errors:
        reasons.append(f"{errors} errors")
    if not summary.get("num_completed", 0):
        reasons.append("no request completed")
    if tbt is None:
        reasons.append("no TBT samples")
    elif tbt > slo_tbt_p99:
        reasons.append(f"P99 TBT {tbt:.4g} s > {slo_tbt_p99:.4g} s")
    if sched is None:
        reasons.append("no scheduling-delay samples")
    elif sched > slo_sched_delay_p50:
        reasons.append(f"median scheduling delay {sched:.4g} s > {slo_sched_delay_p50:.4g} s")
    return CapacityProbe(
        qps=qps,
        tbt_p99_s=tbt,
        sched_delay_p50_s=sched,
        num_errors=errors,
        ok=not reasons,
        reason="; ".join(reasons),
    )


def find_capacity(
    run_at_qps: Callable[[float], Mapping[str, Any]],
    slo_tbt_p99: float,
    slo_sched_delay_p50: float,
    lo_qps: float,
    hi_qps: float,
    max_iters: int = 12,
    *,
    rel_tol: float = 0.05,
    growth: float = 2.0,
    max_qps: float | None = None,
    on_probe: Callable[[CapacityProbe], None] | None = None,
) -> CapacityResult:
    """Highest arrival rate with P99 TBT <= slo_tbt_p99 and median scheduling delay <=
    slo_sched_delay_p50 (seconds), calling `run_at_qps` at most `max_iters` times.

    run_at_qps(qps) replays the workload at `qps` requests/s and returns its summary.
    rel_tol: stop bisecting once (lowest failing - highest passing) <= rel_tol * passing.
    growth: factor by which hi is raised while it still passes (> 1).
    max_qps: never probe above this (None: no cap beyond max_iters).
    on_probe: called after each probe (progress output).
    """
    checks = (
        ("slo_tbt_p99", slo_tbt_p99),
        ("slo_sched_delay_p50", slo_sched_delay_p50),
        ("lo_qps", lo_qps),
        ("rel_tol", rel_tol),
    )
    for name, value in checks:
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}={value} must be a finite number > 0")
    if not (hi_qps > lo_qps and math.isfinite(hi_qps)):
        raise ValueError(f"hi_qps={hi_qps} must be finite and > lo_qps={lo_qps}")
    if max_iters < 1:
        raise ValueError(f"max_iters={max_iters} must be >= 1")
    if not (growth > 1 and math.isfinite(growth)):
        raise ValueError(f"growth={growth} must be a finite number > 1")
    if max_qps is not None and not max_qps >= hi_qps:
        raise ValueError(f"max_qps={max_qps} must be >= hi_qps={hi_qps}")

    probes: list[CapacityProbe] = []

    def probe(qps: float) -> bool:
        p = judge(qps, run_at_qps(qps), slo_tbt_p99, slo_sched_delay_p50)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.ok

    def result(good: float | None, bad: float | None, reason: str) -> CapacityResult:
        return CapacityResult(
            capacity_qps=good,
            lowest_failing_qps=bad,
            stop_reason=reason,
            slo_tbt_p99_s=slo_tbt_p99,
            slo_sched_delay_p50_s=slo_sched_delay_p50,
            probes=tuple(probes),
        )

    if not probe(lo_qps):
        return result(None, lo_qps, "lo_fails")
    good, bad = lo_qps, None
    qps = hi_qps
    # Expand: raise hi until it fails, the cap passes, or the probes run out.
    while bad is None:
        if len(probes) >= max_iters:
            return result(good, None, "max_iters")
        if probe(qps):
            good = qps
            if max_qps is not None and qps >= max_qps:
                return result(good, None, "cap")
            qps = qps * growth if max_qps is None else min(qps * growth, max_qps)
        else:
            bad = qps
    # Bisect the bracket [good (passes), bad (fails)].
    while bad - good > rel_tol * good:
        if len(probes) >= max_iters:
            return result(good, bad, "max_iters")
        mid = 0.5 * (good + bad)
        if probe(mid):
            good = mid
        else:
            bad = mid
    return result(good, bad, "converged")


def capacity_ratios(
    results: Mapping[str, CapacityResult], baseline: str | None
) -> dict[str, float | None]:
    """Each policy's capacity / the baseline's (None where either is undefined)."""
    if baseline is None or baseline not in results:
        return {}
    base = results[baseline].capacity_qps
    return {
        name: (r.capacity_qps / base if r.capacity_qps is not None and base else None)
        for name, r in results.items()
    }


def format_capacity(results: Mapping[str, CapacityResult], baseline: str | None) -> str:
    """A console table: capacity, bracket, stop reason and probes per policy."""
    ratios = capacity_ratios(results, baseline)
    lines = []
    for name, r in results.items():
        cap = "< lo" if r.capacity_qps is None else f"{r.capacity_qps:.4g} req/s"
        bad = "-" if r.lowest_failing_qps is None else f"{r.lowest_failing_qps:.4g}"
        ratio = ratios.get(name)
        rtext = "" if ratio is None else f"  {ratio:.2f}x {baseline}"
        lines.append(
            f"{name}: capacity {cap} (lowest failing {bad}, {r.stop_reason}, "
            f"{len(r.probes)} probes){rtext}"
        )
    return "\n".join(lines)
