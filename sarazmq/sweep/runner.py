"""Running a sweep: every unfinished point, one engine per (policy, chunk), resumable.

The engines come from a `Backend` (`sarazmq.sweep.backends`: real deployments or the
simulator); an engine is opened once and runs all its points (shares, loads, seeds), the
first of them after a warm-up. Each finished point is appended to points.jsonl at once;
at the end the CSV, sweep.json and plots are rewritten from every point in the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.report import write_run
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sweep.grid import SweepGrid, SweepPoint
from sarazmq.sweep.metrics import IterationCost, point_row
from sarazmq.sweep.mix import MixSpec, build_mixed_workload, long_mask
from sarazmq.sweep.report import best_chunks, format_point
from sarazmq.sweep.store import (
    POINTS_CSV,
    POINTS_JSONL,
    SESSIONS_JSONL,
    SWEEP_JSON,
    SweepFileError,
    append_jsonl,
    flag_points,
    read_jsonl,
    read_points,
    write_csv,
    write_sweep_json,
)

CAPACITY_JSON = "capacity.json"
#: Arrival rate of the capacity probe: high enough that every request is queued at once.
PROBE_QPS = 1e6


@dataclass(frozen=True)
class EngineRun:
    """What an engine returns for one workload."""

    records: list[RequestRecord]
    iterations: list[IterationSample]
    settings: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """One engine (policy, chunk) that runs workloads; `warmup` on its first run."""

    def run(
        self, requests: Sequence[WorkloadRequest], description: str, *, warmup: bool
    ) -> EngineRun: ...


#: Opens the engine of (policy, chunk size) for a `with` block.
Backend = Callable[[str, int], contextlib.AbstractContextManager[Engine]]
#: (GEMM FLOP/s, bandwidth bytes/s) of the machine now, or None when not measured.
Probe = Callable[[], tuple[float, float] | None]


@dataclass(frozen=True)
class SweepSettings:
    """How points run and are judged.

    slo_ttft / slo_tbt: goodput's SLOs (seconds; None = not judged).
    cost, peak_flops, bandwidth: MFU/MBU inputs (None = not reported).
    keep_runs: write each point's full run under OUTDIR/points/KEY/.
    mode: "real" or "simulate" (recorded in sweep.json).
    """

    slo_ttft: float | None = None
    slo_tbt: float | None = None
    cost: IterationCost | None = None
    peak_flops: float | None = None
    bandwidth: float | None = None
    keep_runs: bool = True
    mode: str = "real"
    extra: Mapping[str, Any] = field(default_factory=dict)


def capacities(
    out_dir: Path,
    backend: Backend,
    mix: MixSpec,
    shares: Sequence[float],
    policy: str,
    chunk: int,
    seed: int,
    echo: Callable[[str], None] = print,
) -> dict[float, float]:
    """Capacity (requests/s) per share: completed requests / makespan when the share's
    workload arrives all at once on (policy, chunk): the engine's saturated rate, which
    `--load` fractions scale. Kept in OUTDIR/capacity.json and reused by reruns (so the
    points' rates, and keys, stay the same)."""
    path = out_dir / CAPACITY_JSON
    known: dict[float, float] = {}
    if path.is_file():
        known = {float(k): float(v) for k, v in json.loads(path.read_text())["qps"].items()}
    missing = [s for s in shares if s not in known]
    if missing:
        with backend(policy, chunk) as engine:
            for i, share in enumerate(missing):
                reqs = build_mixed_workload(mix, share=share, qps=PROBE_QPS, seed=seed)
                out = engine.run(reqs, f"capacity share {share:g}", warmup=i == 0)
                done = [r for r in out.records if r.ok and r.token_times_s]
                if not done:
                    raise RuntimeError(f"capacity probe at share {share:g}: no request finished")
                span = max(r.token_times_s[-1] for r in done) - min(
                    r.arrival_s for r in out.records
                )
                known[share] = len(done) / span
                echo(f"capacity at share {share:g}: {known[share]:.4g} req/s ({policy}, {chunk})")
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {"policy": policy, "chunk": chunk, "seed": seed, "qps": known}
        path.write_text(json.dumps(data, indent=2) + "\n")
    return {s: known[s] for s in shares}


def point_qps(point: SweepPoint, caps: Mapping[float, float] | None) -> float:
    """The point's arrival rate: its load, or its load x its share's capacity."""
    if point.load_kind == "qps":
        return point.load
    if caps is None or point.share not in caps:
        raise ValueError(f"point {point.key}: no capacity measured for share {point.share:g}")
    return point.load * caps[point.share]


def check_same_workload(
    sessions: Sequence[Mapping[str, Any]], workload: Mapping[str, Any], out_dir: Path
) -> None:
    """SweepFileError when an earlier session of OUTDIR ran another workload (the keys
    do not say it: its points would be skipped as if they were this one's)."""
    for s in sessions:
        old = s.get("workload")
        if old is not None and json.dumps(old, sort_keys=True) != json.dumps(
            dict(workload), sort_keys=True
        ):
            diff = sorted(k for k in {*old, *workload} if old.get(k) != workload.get(k))
            raise SweepFileError(
                f"{out_dir} holds points of another workload or mode (differs in "
                f"{', '.join(diff)}); use another --output-dir"
            )


def run_sweep(
    grid: SweepGrid,
    mix: MixSpec,
    out_dir: Path,
    backend: Backend,
    settings: SweepSettings,
    *,
    caps: Mapping[float, float] | None = None,
    probe: Probe = lambda: None,
    echo: Callable[[str], None] = print,
    plot: bool = True,
) -> dict[str, Any]:
    """Runs every point of `grid` not yet in OUTDIR/points.jsonl, then rewrites
    points.csv, sweep.json and the plots; returns sweep.json's content."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_points(out_dir)
    workload = {"mode": settings.mode, **mix.to_dict()}
    check_same_workload(read_jsonl(out_dir / SESSIONS_JSONL), workload, out_dir)
    todo = [p for p in grid.points() if p.key not in done]
    skipped = len(grid.points()) - len(todo)
    echo(
        f"{len(grid.points())} points: {skipped} already in {POINTS_JSONL} (skipped), "
        f"{len(todo)} to run"
    )
    independent = grid.independent_policies()
    if independent:
        echo(
            f"chunk-independent policies run once per (share, load, seed), chunk 'any': "
            f"{', '.join(independent)}"
        )
    session = time.strftime("%Y%m%dT%H%M%S") + f"-{time.monotonic_ns() % 10**6}"
    if todo:
        start = probe()
        append_jsonl(
            out_dir / SESSIONS_JSONL,
            {"session": session, "probe_start": start, "workload": workload},
        )
        limits = "fixed"
        if start is not None and settings.peak_flops is None and settings.bandwidth is None:
            # MFU/MBU against this machine's measured limits (redone in `finish` with the
            # session's best probe)
            settings = dataclasses.replace(settings, peak_flops=start[0], bandwidth=start[1])
            limits = "probe"
        for policy, chunk in grid.engines():
            points = [p for p in grid.points_of(policy, chunk) if p.key not in done]
            if not points:
                continue
            with backend(policy, points[0].engine_chunk) as engine:
                for i, point in enumerate(points):
                    entry = _run_point(point, engine, i == 0, mix, out_dir, settings, caps)
                    entry["session"] = session
                    entry["limits"] = limits
                    append_jsonl(out_dir / POINTS_JSONL, entry)
                    echo(format_point(entry))
        end = probe()
        append_jsonl(out_dir / SESSIONS_JSONL, {"session": session, "probe_end": end})
    return finish(out_dir, grid, mix, settings, caps, echo=echo, plot=plot)


def _run_point(
    point: SweepPoint,
    engine: Engine,
    warmup: bool,
    mix: MixSpec,
    out_dir: Path,
    settings: SweepSettings,
    caps: Mapping[float, float] | None,
) -> dict[str, Any]:
    qps = point_qps(point, caps)
    requests = build_mixed_workload(mix, share=point.share, qps=qps, seed=point.seed)
    out = engine.run(requests, point.key, warmup=warmup)
    row, summary = point_row(
        out.records,
        out.iterations,
        slo_ttft=settings.slo_ttft,
        slo_tbt=settings.slo_tbt,
        cost=settings.cost,
        peak_flops=settings.peak_flops,
        bandwidth=settings.bandwidth,
    )
    run_dir = None
    if settings.keep_runs:
        run_dir = out_dir / "points" / point.key
        workload = {
            **mix.to_dict(),
            "share": point.share,
            "qps": qps,
            "seed": point.seed,
            "num_long": int(long_mask(mix.num_requests, point.share, point.seed).sum()),
        }
        write_run(
            run_dir, summary, out.records, out.iterations, workload=workload, settings=out.settings
        )
    return {
        "key": point.key,
        "policy": point.policy,
        "chunk": point.chunk,
        "share": point.share,
        "load": point.load,
        "load_kind": point.load_kind,
        "seed": point.seed,
        "qps": qps,
        **row,
        "run_dir": str(run_dir.relative_to(out_dir)) if run_dir is not None else None,
    }


def finish(
    out_dir: Path,
    grid: SweepGrid,
    mix: MixSpec,
    settings: SweepSettings,
    caps: Mapping[float, float] | None,
    *,
    echo: Callable[[str], None] = print,
    plot: bool = True,
) -> dict[str, Any]:
    """Rewrites points.csv, sweep.json and the plots from every point in points.jsonl."""
    sessions = read_jsonl(out_dir / SESSIONS_JSONL)
    points = flag_points(read_points(out_dir).values(), sessions)
    write_csv(out_dir / POINTS_CSV, points)
    best = best_chunks(points, settings.slo_tbt)
    data = {
        "mode": settings.mode,
        "grid": grid.to_dict(),
        "workload": mix.to_dict(),
        "capacity_qps": {f"{k:g}": v for k, v in caps.items()} if caps else None,
        "slo_ttft_s": settings.slo_ttft,
        "slo_tbt_s": settings.slo_tbt,
        "machine": {"peak_flops": settings.peak_flops, "bandwidth": settings.bandwidth},
        "sessions": sessions,
        **dict(settings.extra),
        "best_chunks": best,
        "points": points,
    }
    write_sweep_json(out_dir / SWEEP_JSON, data)
    if plot:
        from sarazmq.sweep.plots import write_plots

        write_plots(out_dir, points, best)
    return data
