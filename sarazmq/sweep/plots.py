"""The sweep's plots (matplotlib's object API, as `sarazmq.replay.plots`; no pyplot).

- chunk_POLICY_LOAD.png: P99 TBT, P99 TTFT and output tokens/s against chunk size, one
  line per long-prompt share (chunk-independent policies as horizontal lines in the
  share's colour, one line style per policy).
- frontier.png: P99 TBT against output tokens/s, one panel per share; every point of a
  policy as a dot, its Pareto frontier (no other point both faster and higher) as a line.
- best_chunk.png: the best chunk size per share (`report.best_chunks`).
Values are seed means (`report.aggregate`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from sarazmq.sweep.report import aggregate

FRONTIER_PNG = "frontier.png"
BEST_CHUNK_PNG = "best_chunk.png"
#: line styles of the chunk-independent policies' horizontal lines
_STYLES = (":", "--", "-.")
_PANELS = (
    ("tbt_p99_s", "P99 TBT (ms)", 1e3),
    ("ttft_p99_s", "P99 TTFT (ms)", 1e3),
    ("output_tokens_per_s", "output tokens/s", 1.0),
)


def _load_name(load: float, kind: str) -> str:
    return f"{load:g} req/s" if kind == "qps" else f"{load:g} x capacity"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_chunk_curves(out_dir: Path, points: Sequence[Mapping[str, Any]]) -> list[Path]:
    """One chunk_POLICY_LOAD.png per chunk-dependent policy and load."""
    agg = aggregate(points)
    curves: dict[tuple[str, float, str], dict[float, list[tuple[int, dict[str, Any]]]]] = (
        defaultdict(lambda: defaultdict(list))
    )
    flat: dict[tuple[float, str], list[tuple[str, float, dict[str, Any]]]] = defaultdict(list)
    for (policy, load, kind, share, chunk), a in agg.items():
        if chunk is None:
            flat[(load, kind)].append((policy, share, a))
        else:
            curves[(policy, load, kind)][share].append((int(chunk), a))
    paths = []
    for (policy, load, kind), by_share in sorted(curves.items()):
        fig = Figure(figsize=(15, 4.4), dpi=100)
        axes = fig.subplots(1, len(_PANELS))
        colors: dict[float, str] = {}
        for ax, (metric, label, scale) in zip(axes, _PANELS, strict=True):
            for share, series in sorted(by_share.items()):
                series.sort(key=lambda t: t[0])
                xs = [c for c, a in series if a.get(metric) is not None]
                ys = [a[metric] * scale for c, a in series if a.get(metric) is not None]
                (line,) = ax.plot(xs, ys, marker="o", label=f"share {share:g}")
                colors[share] = line.get_color()
            others = sorted({o for o, _, _ in flat.get((load, kind), [])})
            for other, share, a in flat.get((load, kind), []):
                if a.get(metric) is not None:
                    ax.axhline(
                        a[metric] * scale,
                        linestyle=_STYLES[others.index(other) % len(_STYLES)],
                        color=colors.get(share, "gray"),
                        label=f"{other} (any chunk), share {share:g}",
                    )
            ax.set_xscale("log", base=2)
            chunks = sorted({c for series in by_share.values() for c, _ in series})
            ax.set_xticks(chunks, [str(c) for c in chunks])
            ax.minorticks_off()
            ax.set_xlabel("chunk size (tokens)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        fig.suptitle(f"{policy} at {_load_name(load, kind)}")
        name = f"chunk_{_safe(policy)}_{'q' if kind == 'qps' else 'l'}{load:g}.png"
        paths.append(_save(fig, out_dir / name))
    return paths


def pareto(xy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (latency, throughput) points no other point beats on both (lower latency and
    higher throughput), by latency."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(xy, key=lambda p: (p[0], -p[1])):
        if not out or y > out[-1][1]:
            out.append((x, y))
    return out


def plot_frontier(path: Path, points: Sequence[Mapping[str, Any]]) -> Path:
    """frontier.png: P99 TBT against output tokens/s, one panel per share."""
    agg = aggregate(points)
    by_share: dict[float, dict[str, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for (policy, _load, _kind, share, _chunk), a in agg.items():
        if a.get("tbt_p99_s") is not None and a.get("output_tokens_per_s") is not None:
            by_share[share][policy].append((a["output_tokens_per_s"], a["tbt_p99_s"] * 1e3))
    shares = sorted(by_share) or [0.0]
    policies = sorted({p for per in by_share.values() for p in per})
    fig = Figure(figsize=(5 * len(shares), 4.4), dpi=100)
    axes = fig.subplots(1, len(shares), squeeze=False)[0]
    for ax, share in zip(axes, shares, strict=True):
        for policy, xy in sorted(by_share.get(share, {}).items()):
            color = f"C{policies.index(policy) % 10}"  # one colour per policy in every panel
            ax.scatter([p[0] for p in xy], [p[1] for p in xy], s=12, alpha=0.4, color=color)
            # frontier: the highest throughput for a given latency (x = throughput here)
            front = pareto([(lat, thr) for thr, lat in xy])
            ax.plot(
                [t for _, t in front],
                [lat for lat, _ in front],
                marker="o",
                color=color,
                label=policy,
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("P99 TBT (ms)")
        ax.set_title(f"long-prompt share {share:g}")
        ax.grid(alpha=0.3)
        if by_share.get(share):
            ax.legend(fontsize="small")
    return _save(fig, path)


def plot_best_chunk(path: Path, best: Sequence[Mapping[str, Any]]) -> Path:
    """best_chunk.png: the best chunk per share, one line per (policy, load)."""
    lines: dict[tuple[str, float, str], list[tuple[float, int]]] = defaultdict(list)
    for e in best:
        if e.get("best_chunk") is not None:
            lines[(e["policy"], e["load"], e["load_kind"])].append((e["share"], e["best_chunk"]))
    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    ax = fig.add_subplot()
    for (policy, load, kind), xy in sorted(lines.items()):
        xy.sort()
        ax.plot(
            [s for s, _ in xy],
            [c for _, c in xy],
            marker="o",
            label=f"{policy} @ {_load_name(load, kind)}",
        )
    if lines:
        ax.set_yscale("log", base=2)
        chunks = sorted({c for xy in lines.values() for _, c in xy})
        ax.set_yticks(chunks, [str(c) for c in chunks])
        ax.minorticks_off()
        ax.legend(fontsize="small")
    else:
        ax.text(
            0.5,
            0.5,
            "no best chunk (no chunk met the SLO)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("long-prompt share")
    ax.set_ylabel("best chunk size (tokens)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(
    out_dir: Path,
    points: Sequence[Mapping[str, Any]],
    best: Sequence[Mapping[str, Any]],
) -> list[Path]:
    """Every plot of the sweep into out_dir; returns their paths."""
    paths = plot_chunk_curves(out_dir, points)
    paths.append(plot_frontier(out_dir / FRONTIER_PNG, points))
    paths.append(plot_best_chunk(out_dir / BEST_CHUNK_PNG, best))
    return paths
