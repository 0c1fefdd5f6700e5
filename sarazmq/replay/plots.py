"""The replay's plots: latency CDFs, tokens over time, prefill/decode tokens per iteration.

matplotlib's object API (`Figure` rendered by the Agg canvas), never pyplot, so no global
backend or figure registry is touched and nothing needs a display. Times are relative to
the run's first arrival ("seconds into the run").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from sarazmq.replay.metrics import IterationSample, RequestRecord


def cdf_xy(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=np.float64))  # [n]
    y = np.arange(1, x.size + 1) / max(x.size, 1)  # [n]
    return x, y


def plot_cdfs(path: Path, series: Mapping[str, Sequence[float]], xlabel: str, title: str) -> None:
    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    ax = fig.add_subplot()
    for name, values in series.items():
        if len(values):
            x, y = cdf_xy(values)
            ax.step(x, y, where="post", label=f"{name} (n={len(values)})")
    if not any(len(v) for v in series.values()):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1 or any(len(v) for v in series.values()):
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_tokens_over_time(
    path: Path,
    records: Sequence[RequestRecord],
    iterations: Sequence[IterationSample],
    t0: float,
    max_requests_shown: int = 12,
) -> None:
    """Top: output tokens completed over time (all requests); flat stretches are stalls.
    Bottom: the token count of a few requests over time, with the iterations that ran
    prefill marked, as in Sarathi-Serve's figure 1 (decode stalls behind prefills)."""
    fig = Figure(figsize=(8.0, 6.4), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True)
    times = np.sort(np.array([t for r in records for t in r.token_times_s]) - t0)  # [tokens]
    if times.size:
        top.step(times, np.arange(1, times.size + 1), where="post", lw=1.0)
    top.set_ylabel("output tokens completed")
    top.set_title("tokens completed over time")
    top.grid(alpha=0.3)

    shown = [r for r in records if len(r.token_times_s) >= 2]
    if len(shown) > max_requests_shown:
        pick = np.linspace(0, len(shown) - 1, max_requests_shown).round().astype(int)
        shown = [shown[i] for i in pick]
    for r in shown:
        t = np.asarray(r.token_times_s) - t0
        bottom.step(t, np.arange(1, t.size + 1), where="post", lw=1.0, label=r.request_id)
    prefill_ends = [it.end_s - t0 for it in iterations if it.num_prefill_tokens > 0]
    if prefill_ends:
        bottom.vlines(
            prefill_ends,
            0,
            1,
            transform=bottom.get_xaxis_transform(),
            colors="grey",
            alpha=0.15,
            lw=0.8,
            label="iteration with prefill",
        )
    bottom.set_xlabel("time into run (s)")
    bottom.set_ylabel("tokens of the request")
    bottom.grid(alpha=0.3)
    if shown:
        bottom.legend(loc="upper left", fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_iteration_tokens(path: Path, iterations: Sequence[IterationSample], t0: float) -> None:
    """Decode tokens and, stacked above them, prefill tokens of each iteration over the
    iteration's span (idle time between iterations at zero): a token budget shows as a
    flat ceiling, a prefill-prioritizing scheduler as tall prefill spikes."""
    fig = Figure(figsize=(8.0, 4.4), dpi=100)
    ax: Axes = fig.add_subplot()
    its = sorted(iterations, key=lambda it: it.start_s)
    start = np.array([it.start_s - t0 for it in its])  # [n]
    end = np.array([it.end_s - t0 for it in its])  # [n]
    prefill = np.array([it.num_prefill_tokens for it in its], dtype=np.float64)  # [n]
    decode = np.array([it.num_decode_tokens for it in its], dtype=np.float64)  # [n]
    if its and np.all(end >= start) and np.all(start[1:] >= end[:-1]):
        # edges s0 e0 s1 e1 ...; values v0 0 v1 0 ... (zeros are the idle gaps)
        edges = np.stack([start, end], axis=1).reshape(-1)  # [2n]
        pad = np.zeros_like(decode)

        def spans(v: np.ndarray) -> np.ndarray:
            return np.stack([v, pad], axis=1).reshape(-1)[:-1]  # [2n-1]

        ax.stairs(spans(decode), edges, fill=True, alpha=0.8, label="decode tokens")
        ax.stairs(
            spans(decode + prefill),
            edges,
            baseline=spans(decode),
            fill=True,
            alpha=0.8,
            label="prefill tokens",
        )
        ax.legend(loc="upper right")
    elif its:  # overlapping iterations (pipelined): points at each start
        ax.plot(start, prefill, ".", ms=3, label="prefill tokens", alpha=0.7)
        ax.plot(start, decode, ".", ms=3, label="decode tokens", alpha=0.7)
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("time into run (s)")
    ax.set_ylabel("tokens in iteration")
    ax.set_title("prefill vs decode tokens per iteration")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------- one run
