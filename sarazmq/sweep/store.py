"""A sweep's files: points.jsonl (append-only, what makes it resumable), sessions.jsonl
(the machine probe at the start and end of every invocation), points.csv and sweep.json
(rewritten at the end of every invocation).

A point's line holds its key fields, the resolved rate, its session, its metrics row and
where its full run went. A rerun reads the file, skips every key already there (a line
appended by hand counts too) and stops with an error naming the line if one is not a
JSON object with a "key".

Machine drift: a session's probe is (GEMM FLOP/s, memory bandwidth bytes/s). A point is
flagged machine_changed when its session's start or end probe differs by more than
MACHINE_TOLERANCE from the sweep's first probe, or its end from its start. Where MFU/MBU
are measured against the probe, they are recomputed at the end against the larger of the
session's two probes (a busy machine makes a probe read low).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sarazmq.sweep.metrics import utilization_of

POINTS_JSONL = "points.jsonl"
SESSIONS_JSONL = "sessions.jsonl"
POINTS_CSV = "points.csv"
SWEEP_JSON = "sweep.json"
MACHINE_TOLERANCE = 0.15

KEY_COLUMNS = ("key", "policy", "chunk", "share", "load", "load_kind", "seed", "qps")
METRIC_COLUMNS = (
    "num_requests",
    "num_completed",
    "num_errors",
    "makespan_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p95_s",
    "tbt_p99_s",
    "tpot_p50_s",
    "decode_stall_p99_s",
    "stall_total_s",
    "stall_count",
    "busy_fraction",
    "mfu",
    "mbu",
    "num_iterations",
    "preemptions",
    "slo_attainment",
    "goodput_rps",
)
CSV_COLUMNS = (*KEY_COLUMNS, *METRIC_COLUMNS, "machine_changed", "session")


class SweepFileError(ValueError):
    """A sweep file that cannot be read (names the file and line)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file as a dict ([] if the file is missing); blank lines
    are skipped, anything else that is not a JSON object raises SweepFileError."""
    if not path.is_file():
        return []
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SweepFileError(
                    f"{path} line {n} is not valid JSON ({e.msg}); fix or delete that line "
                    "to resume"
                ) from None
            if not isinstance(obj, dict):
                raise SweepFileError(f"{path} line {n} is not a JSON object")
            out.append(obj)
    return out


def read_points(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The finished points of a sweep by key (the first line of a key wins)."""
    path = out_dir / POINTS_JSONL
    points: dict[str, dict[str, Any]] = {}
    for n, obj in enumerate(read_jsonl(path), 1):
        key = obj.get("key")
        if not isinstance(key, str) or not key:
            raise SweepFileError(f"{path}: entry {n} has no string 'key'")
        points.setdefault(key, obj)
    return points


def append_jsonl(path: Path, obj: Mapping[str, Any]) -> None:
    """Append one line and flush it (a killed run loses at most the point in flight)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(obj, allow_nan=False) + "\n")
        f.flush()


def _moved(a: Sequence[float] | None, b: Sequence[float] | None, tol: float) -> bool:
    if not a or not b:
        return False
    return any(x > 0 and abs(y / x - 1.0) > tol for x, y in zip(a, b, strict=True))


def changed_sessions(
    sessions: Iterable[Mapping[str, Any]], tol: float = MACHINE_TOLERANCE
) -> set[str]:
    """Ids of the sessions run under a changed machine (see the module docstring).
    A session entry: {"session": id, "probe_start": [flops, bw], "probe_end": [...]}."""
    merged: dict[str, dict[str, Any]] = {}
    for s in sessions:
        merged.setdefault(str(s.get("session")), {}).update(s)
    reference = None
    out = set()
    for sid, s in merged.items():
        start, end = s.get("probe_start"), s.get("probe_end")
        if reference is None:
            reference = start
        if _moved(start, end, tol) or _moved(reference, start, tol) or _moved(reference, end, tol):
            out.add(sid)
    return out


def session_limits(sessions: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per session, the best (GEMM FLOP/s, bandwidth) of its start and end probes: a
    probe only underestimates (other load slows it), so the larger is nearer the truth."""
    out: dict[str, tuple[float, float]] = {}
    for s in sessions:
        for name in ("probe_start", "probe_end"):
            probe = s.get(name)
            if probe:
                sid = str(s.get("session"))
                old = out.get(sid, (0.0, 0.0))
                out[sid] = (max(old[0], float(probe[0])), max(old[1], float(probe[1])))
    return out


def flag_points(
    points: Iterable[dict[str, Any]], sessions: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The points with machine_changed set from their session's probes, and (points whose
    limits came from the probe: limits == "probe") MFU/MBU against `session_limits`."""
    changed = changed_sessions(sessions)
    limits = session_limits(sessions)
    out = []
    for p in points:
        q = {**p, "machine_changed": str(p.get("session")) in changed}
        best = limits.get(str(p.get("session")))
        if p.get("limits") == "probe" and best is not None:
            q["mfu"], q["mbu"] = utilization_of(q, *best)
        out.append(q)
    return out


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_csv(path: Path, points: Sequence[Mapping[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for p in points:
            w.writerow([_cell(p.get(c)) for c in CSV_COLUMNS])


def write_sweep_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
