"""What a built workload looks like: the facts printed as a run's header and saved with it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sarazmq.replay.traces import MOONCAKE_BLOCK_TOKENS, load_trace
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, fit_lengths
from sarazmq.scheduler import ROOT_KEY, sha256_block_key


def _length_stats(
    source: np.ndarray, fitted: np.ndarray, scale: float, lo: int, hi: int | None
) -> dict[str, Any]:
    _, n_clipped, n_raised = fit_lengths(source, scale, lo, hi)
    return {
        "source_mean": float(source.mean()) if len(source) else None,
        "mean": float(fitted.mean()) if len(fitted) else None,
        "min": int(fitted.min()) if len(fitted) else None,
        "max": int(fitted.max()) if len(fitted) else None,
        "total": int(fitted.sum()),
        "clipped_to_max": n_clipped,
        "raised_to_min": n_raised,
    }


def ideal_prefix_hits(prompts: Iterable[Sequence[int]], block_size: int) -> tuple[int, int]:
    """(prompt tokens, tokens an infinite prefix cache would hit), the prompts sent in
    this order, each cached once sent: the engine's own rule (whole blocks, contiguous
    from block 0, at most length - 1 tokens), with no eviction and no timing (a prompt
    hits everything sent before it, even if that is still being prefilled)."""
    seen: set[bytes] = set()
    queries = hits = 0
    for prompt in prompts:
        n = len(prompt)
        queries += n
        key = ROOT_KEY
        hit_open = True
        for i in range(n // block_size):
            key = sha256_block_key(key, prompt[i * block_size : (i + 1) * block_size], None)
            if hit_open and (i + 1) * block_size <= n - 1 and key in seen:
                hits += block_size
            else:
                hit_open = False
            seen.add(key)
    return queries, hits


def prefix_sharing_info(
    spec: WorkloadSpec, requests: Sequence[WorkloadRequest], block_size: int
) -> dict[str, Any]:
    """The trace's shared-prefix facts for a prefix-sharing workload: its block length in
    tokens (512 x length_scale), whether the engine block size divides it (otherwise
    the shared part of a prompt does not end on a cache block and a little is lost),
    and the ideal hit rate (`ideal_prefix_hits`)."""
    trace_block = max(1, math.floor(MOONCAKE_BLOCK_TOKENS * spec.length_scale + 0.5))
    queries, hits = ideal_prefix_hits((r.prompt_token_ids for r in requests), block_size)
    return {
        "trace_block_tokens": trace_block,
        "block_size": block_size,
        "block_size_divides": trace_block % block_size == 0,
        "ideal_queries": queries,
        "ideal_hits": hits,
        "ideal_hit_rate": hits / queries if queries else None,
    }


def describe(
    spec: WorkloadSpec, requests: Sequence[WorkloadRequest], block_size: int = 16
) -> dict[str, Any]:
    """What `build_workload(spec)` did, JSON-ready: the spec, the resolved length and
    arrival sources, trace rows read and used, how many lengths were clipped or raised,
    mean lengths before and after fitting, the arrival span and its effective rate;
    with prefix sharing also "prefix_sharing" (`prefix_sharing_info` for the engine's
    KV block_size).

    duration_s is last arrival - first; effective_qps = (n - 1) / duration_s (n arrivals
    span n - 1 gaps), None when every request arrives at once.
    """
    info: dict[str, Any] = {
        "spec": spec.to_dict(),
        "lengths": spec.resolved_lengths(),
        "arrivals": spec.resolved_arrivals(),
        "num_requests": len(requests),
    }
    if spec.trace_path is not None:
        rows_in_trace = len(load_trace(spec.trace_path, spec.trace_kind))
        info["trace"] = {
            "path": str(Path(spec.trace_path)),
            "rows_in_trace": rows_in_trace,
            "start": spec.start,
            "rows_used": len(requests),
        }
    src_in = np.array([r.source_input_tokens for r in requests], dtype=np.int64)
    src_out = np.array([r.source_output_tokens for r in requests], dtype=np.int64)
    fit_in = np.array([r.input_tokens for r in requests], dtype=np.int64)
    fit_out = np.array([r.output_tokens for r in requests], dtype=np.int64)
    info["input_tokens"] = _length_stats(
        src_in, fit_in, spec.length_scale, spec.min_input_tokens, spec.max_input_tokens
    )
    info["output_tokens"] = _length_stats(
        src_out, fit_out, spec.length_scale, spec.min_output_tokens, spec.max_output_tokens
    )
    times = np.array([r.arrival_s for r in requests], dtype=np.float64)
    duration = float(times.max() - times.min()) if len(times) else 0.0
    gaps = np.diff(times)
    info["duration_s"] = duration
    info["effective_qps"] = (len(times) - 1) / duration if duration > 0 else None
    info["interarrival_cv"] = (
        float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else None
    )
    if spec.prefix_sharing:
        info["prefix_sharing"] = prefix_sharing_info(spec, requests, block_size)
    return info


def format_header(info: dict[str, Any]) -> str:
    """A few readable lines of `describe`'s output for the top of a run."""
    spec = info["spec"]
    lines = []
    if "trace" in info:
        t = info["trace"]
        lines.append(
            f"trace: {t['path']} rows {t['start']}..{t['start'] + t['rows_used'] - 1} "
            f"of {t['rows_in_trace']}"
        )
    arr = info["arrivals"]
    if arr in ("poisson", "gamma"):
        arr += f"(qps={spec['qps']}" + (f", cv={spec['cv']})" if arr == "gamma" else ")")
    lines.append(
        f"requests: {info['num_requests']}  lengths: {info['lengths']}  arrivals: {arr}  "
        f"time_scale: {spec['time_scale']}  length_scale: {spec['length_scale']}  "
        f"seed: {spec['seed']}"
    )
    for key, lo, hi in (
        ("input_tokens", "min_input_tokens", "max_input_tokens"),
        ("output_tokens", "min_output_tokens", "max_output_tokens"),
    ):
        s = info[key]
        mean = "-" if s["mean"] is None else f"{s['mean']:.1f}"
        src = "-" if s["source_mean"] is None else f"{s['source_mean']:.1f}"
        lines.append(
            f"{key}: mean {mean} (source {src}), range [{s['min']}, {s['max']}], "
            f"limits [{spec[lo]}, {spec[hi]}]: {s['clipped_to_max']} clipped, "
            f"{s['raised_to_min']} raised"
        )
    ps = info.get("prefix_sharing")
    if ps is not None:
        rate = ps["ideal_hit_rate"]
        lines.append(
            f"prefix sharing: trace blocks of {ps['trace_block_tokens']} tokens, KV blocks of "
            f"{ps['block_size']}"
            + ("" if ps["block_size_divides"] else " (does NOT divide it: hits are lost)")
            + ", ideal hit rate (infinite cache) "
            + ("-" if rate is None else f"{100 * rate:.1f} %")
        )
    qps = info["effective_qps"]
    lines.append(
        f"arrivals span {info['duration_s']:.2f} s, effective rate "
        + ("all at once" if qps is None else f"{qps:.3f} req/s")
    )
    return "\n".join(lines)
