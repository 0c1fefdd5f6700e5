"""The sweep's tables: one line per finished point, and the best chunk per share.

Points are averaged over seeds first (`aggregate`). The best chunk of a (policy, load,
share): with a P99 TBT SLO, the chunk with the highest goodput among those whose P99 TBT
meets it (ties: the lower P99 TBT; none when no chunk meets it); without one, the chunk
with the lowest P99 TBT. It is compared with DEFAULT_CHUNK measured in the same sweep.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sarazmq.sweep.grid import DEFAULT_CHUNK
from sarazmq.sweep.metrics import row_value
from sarazmq.sweep.store import METRIC_COLUMNS

GroupKey = tuple[str, float, str, float, int | None]  # policy, load, load_kind, share, chunk


def aggregate(points: Sequence[Mapping[str, Any]]) -> dict[GroupKey, dict[str, Any]]:
    """Points averaged over seeds, by (policy, load, load_kind, share, chunk); each
    aggregate has the mean of every metric, num_seeds, qps (mean) and machine_changed
    (any)."""
    groups: dict[GroupKey, list[Mapping[str, Any]]] = defaultdict(list)
    for p in points:
        key = (p["policy"], float(p["load"]), p["load_kind"], float(p["share"]), p["chunk"])
        groups[key].append(p)
    out = {}
    for key, rows in groups.items():
        agg: dict[str, Any] = {"num_seeds": len(rows)}
        for name in (*METRIC_COLUMNS, "qps"):
            vals = [v for r in rows if (v := row_value(r, name)) is not None]
            agg[name] = float(np.mean(vals)) if vals else None
        agg["machine_changed"] = any(bool(r.get("machine_changed")) for r in rows)
        out[key] = agg
    return out


def best_chunk(by_chunk: Mapping[int, Mapping[str, Any]], slo_tbt: float | None) -> int | None:
    """The best chunk among {chunk: aggregate} (see the module docstring)."""

    def tbt(c: int) -> float:
        v = row_value(by_chunk[c], "tbt_p99_s")
        return float("inf") if v is None else v

    chunks = [c for c in by_chunk if tbt(c) < float("inf")]
    if slo_tbt is None:
        return min(chunks, key=lambda c: (tbt(c), c)) if chunks else None
    ok = [c for c in chunks if tbt(c) <= slo_tbt]
    if not ok:
        return None
    return max(ok, key=lambda c: (row_value(by_chunk[c], "goodput_rps") or 0.0, -tbt(c), -c))


def best_chunks(points: Sequence[Mapping[str, Any]], slo_tbt: float | None) -> list[dict[str, Any]]:
    """One entry per (policy, load, share) of a chunk-dependent policy: the best chunk,
    its metrics and its ratios to DEFAULT_CHUNK (None where that chunk was not run)."""
    agg = aggregate(points)
    cells: dict[tuple[str, float, str, float], dict[int, dict[str, Any]]] = defaultdict(dict)
    for (policy, load, kind, share, chunk), a in agg.items():
        if chunk is not None:
            cells[(policy, load, kind, share)][int(chunk)] = a
    out = []
    for (policy, load, kind, share), by_chunk in sorted(cells.items()):
        best = best_chunk(by_chunk, slo_tbt)
        entry: dict[str, Any] = {
            "policy": policy,
            "load": load,
            "load_kind": kind,
            "share": share,
            "best_chunk": best,
            "machine_changed": any(a["machine_changed"] for a in by_chunk.values()),
        }
        b = by_chunk.get(best) if best is not None else None
        d = by_chunk.get(DEFAULT_CHUNK)
        for name in ("tbt_p99_s", "goodput_rps", "output_tokens_per_s", "ttft_p99_s"):
            bv = row_value(b, name) if b else None
            dv = row_value(d, name) if d else None
            entry[name] = bv
            entry[f"{name}_vs_default"] = bv / dv if bv is not None and dv else None
        out.append(entry)
    return out


def _f(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _load(load: float, kind: str) -> str:
    return f"{load:g} req/s" if kind == "qps" else f"{load:g} x cap"


def format_best_chunks(entries: Sequence[Mapping[str, Any]], slo_tbt: float | None) -> str:
    """The best-chunk table (ratios are best / chunk DEFAULT_CHUNK, same sweep)."""
    rule = (
        f"highest goodput with P99 TBT <= {slo_tbt * 1e3:g} ms"
        if slo_tbt is not None
        else "lowest P99 TBT (no --slo-tbt)"
    )
    header = (
        f"best chunk per share ({rule}); x{DEFAULT_CHUNK} = ratio to chunk {DEFAULT_CHUNK}\n"
        f"{'policy':<16} {'load':>12} {'share':>6} {'best':>6} {'P99 TBT ms':>11} "
        f"{'x' + str(DEFAULT_CHUNK):>6} {'goodput/s':>10} {'x' + str(DEFAULT_CHUNK):>6} "
        f"{'out tok/s':>10} {'x' + str(DEFAULT_CHUNK):>6}"
    )
    lines = [header]
    for e in entries:
        flag = "  *machine changed" if e["machine_changed"] else ""
        lines.append(
            f"{e['policy']:<16} {_load(e['load'], e['load_kind']):>12} {e['share']:>6g} "
            f"{e['best_chunk'] if e['best_chunk'] is not None else '-':>6} "
            f"{_f(e['tbt_p99_s'], 1e3):>11} {_f(e['tbt_p99_s_vs_default'], digits=2):>6} "
            f"{_f(e['goodput_rps'], digits=3):>10} {_f(e['goodput_rps_vs_default'], digits=2):>6} "
            f"{_f(e['output_tokens_per_s']):>10} "
            f"{_f(e['output_tokens_per_s_vs_default'], digits=2):>6}{flag}"
        )
    if len(lines) == 1:
        lines.append("(no chunk-dependent policy in the grid)")
    return "\n".join(lines)


def format_point(p: Mapping[str, Any]) -> str:
    """One line for a finished point."""
    changed = "  *machine changed" if p.get("machine_changed") else ""
    return (
        f"{p['key']}: {_f(p.get('qps'), digits=3)} req/s  out {_f(p.get('output_tokens_per_s'))} "
        f"tok/s  TTFT p99 {_f(p.get('ttft_p99_s'), 1e3, 0)} ms  TBT p50/p99 "
        f"{_f(p.get('tbt_p50_s'), 1e3, 0)}/{_f(p.get('tbt_p99_s'), 1e3, 0)} ms  stall "
        f"{_f(p.get('stall_total_s'), digits=2)} s  busy {_f(p.get('busy_fraction'), digits=2)}"
        f"  MFU {_f(p.get('mfu'), 100)}%  SLO {_f(p.get('slo_attainment'), digits=2)}{changed}"
    )
