"""Outputs of a replay: JSON summary, CSV records, PNG plots, console tables.

The plots themselves are `sarazmq.replay.plots`.

In the CSV files and plots every time is relative to the run's first arrival, so that
the numbers read as "seconds into the run" whatever the monotonic clock's origin.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from sarazmq.replay.metrics import IterationSample, RequestRecord, request_metrics
from sarazmq.replay.plots import (
    plot_cdfs,
    plot_iteration_tokens,
    plot_tokens_over_time,
)

SUMMARY_JSON = "summary.json"
REQUESTS_CSV = "requests.csv"
ITERATIONS_CSV = "iterations.csv"
RECORDS_JSONL = "records.jsonl"
TBT_CDF_PNG = "tbt_cdf.png"
TTFT_CDF_PNG = "ttft_cdf.png"
TOKENS_OVER_TIME_PNG = "tokens_over_time.png"
ITERATION_TOKENS_PNG = "iteration_tokens.png"
COMPARISON_JSON = "comparison.json"
COMPARISON_TXT = "comparison.txt"
COMPARE_TBT_CDF_PNG = "compare_tbt_cdf.png"
COMPARE_TTFT_CDF_PNG = "compare_ttft_cdf.png"

# Latency distributions shown in the tables: (summary key, label). Values are seconds in
# the summary and milliseconds on screen.
LATENCY_ROWS = (
    ("ttft_s", "TTFT"),
    ("tbt_s", "TBT"),
    ("tpot_s", "TPOT"),
    ("e2e_s", "E2E latency"),
    ("scheduling_delay_s", "sched delay"),
    ("decode_stall_s", "decode stall"),
)

# Rows of the comparison table: (label, path into the summary, multiplier, lower is better).
COMPARISON_ROWS: tuple[tuple[str, tuple[str, ...], float, bool], ...] = (
    ("TTFT p50 (ms)", ("ttft_s", "p50"), 1e3, True),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), 1e3, True),
    ("TBT p50 (ms)", ("tbt_s", "p50"), 1e3, True),
    ("TBT p99 (ms)", ("tbt_s", "p99"), 1e3, True),
    ("TBT max (ms)", ("tbt_s", "max"), 1e3, True),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), 1e3, True),
    ("E2E p50 (s)", ("e2e_s", "p50"), 1.0, True),
    ("E2E p99 (s)", ("e2e_s", "p99"), 1.0, True),
    ("sched delay p50 (ms)", ("scheduling_delay_s", "p50"), 1e3, True),
    ("decode stall p99 (ms)", ("decode_stall_s", "p99"), 1e3, True),
    ("preemptions", ("total_preemptions",), 1.0, True),
    ("requests/s", ("throughput", "requests_per_s"), 1.0, False),
    ("input tok/s", ("throughput", "input_tokens_per_s"), 1.0, False),
    ("output tok/s", ("throughput", "output_tokens_per_s"), 1.0, False),
    ("goodput fraction", ("goodput", "fraction"), 1.0, False),
    ("errors", ("num_errors",), 1.0, True),
)


# ---------------------------------------------------------------------------- helpers


def _get(summary: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = summary
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _t0(records: Sequence[RequestRecord], iterations: Sequence[IterationSample]) -> float:
    """The run's time origin: its first arrival (or first iteration without requests)."""
    starts = [r.arrival_s for r in records] or [it.start_s for it in iterations]
    return min(starts) if starts else 0.0


def relative_time(value: float | None, t0: float) -> float | None:
    return None if value is None else value - t0


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _write_json(path: Path, data: Any) -> None:
    # allow_nan=False: a NaN would make the file unreadable to strict JSON parsers.
    path.write_text(json.dumps(data, indent=2, default=_json_default, allow_nan=False) + "\n")


REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "server_arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "last_token_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "scheduling_delay_s",
    "decode_stall_s",
    "tbt_p99_s",
    "client_ttft_s",
    "client_e2e_s",
    "num_preemptions",
    "finish_reason",
    "error",
)
ITERATION_COLUMNS = (
    "step",
    "start_s",
    "end_s",
    "duration_s",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_seqs",
    "cache_queries",
    "cache_hits",
    "num_prefill_seqs",
    "prefill_attention_pairs",
    "num_decode_seqs",
    "decode_context_tokens",
    "num_sampled",
    "forward_s",
    "token_budget",
)


def write_requests_csv(path: Path, records: Sequence[RequestRecord], t0: float) -> None:
    """One row per request: its times (relative to t0) and derived metrics."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for r in records:
            m = request_metrics(r)
            first = r.token_times_s[0] if r.token_times_s else None
            last = r.token_times_s[-1] if r.token_times_s else None
            values = (
                r.request_id,
                r.arrival_s - t0,
                relative_time(r.server_arrival_s, t0),
                relative_time(r.first_scheduled_s, t0),
                relative_time(first, t0),
                relative_time(last, t0),
                r.num_prompt_tokens,
                r.num_output_tokens,
                m.ttft_s,
                m.tpot_s,
                m.e2e_s,
                m.scheduling_delay_s,
                m.decode_stall_s,
                m.tbt_p99_s,
                m.client_ttft_s,
                m.client_e2e_s,
                r.num_preemptions,
                r.finish_reason or "",
                r.error,
            )
            w.writerow(["" if v is None else v for v in values])


def write_iterations_csv(path: Path, iterations: Sequence[IterationSample], t0: float) -> None:
    """One row per scheduler iteration (times relative to t0)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(ITERATION_COLUMNS)
        for it in iterations:
            w.writerow(
                (
                    it.step,
                    it.start_s - t0,
                    it.end_s - t0,
                    it.duration_s,
                    it.num_prefill_tokens,
                    it.num_decode_tokens,
                    it.num_seqs,
                    it.cache_queries,
                    it.cache_hits,
                    it.num_prefill_seqs,
                    it.prefill_attention_pairs,
                    it.num_decode_seqs,
                    it.decode_context_tokens,
                    it.num_sampled,
                    it.forward_s,
                    it.token_budget,
                )
            )


def write_run(
    output_dir: str | Path,
    summary: Mapping[str, Any],
    records: Sequence[RequestRecord],
    iterations: Sequence[IterationSample],
    *,
    workload: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write summary.json (the summary plus `workload` and engine `settings`),
    requests.csv, iterations.csv, records.jsonl (every request's record, token times
    included, for `read_records`) and the four PNG plots (unless `plots` is False: they
    take about a minute for millions of tokens) into `output_dir` (created if missing).
    Returns the written paths by short name."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = _t0(records, iterations)
    paths = {
        "summary": out / SUMMARY_JSON,
        "requests": out / REQUESTS_CSV,
        "iterations": out / ITERATIONS_CSV,
        "records": out / RECORDS_JSONL,
        "tbt_cdf": out / TBT_CDF_PNG,
        "ttft_cdf": out / TTFT_CDF_PNG,
        "tokens_over_time": out / TOKENS_OVER_TIME_PNG,
        "iteration_tokens": out / ITERATION_TOKENS_PNG,
    }
    _write_json(
        paths["summary"],
        {**summary, "workload": dict(workload or {}), "settings": dict(settings or {})},
    )
    write_requests_csv(paths["requests"], records, t0)
    write_iterations_csv(paths["iterations"], iterations, t0)
    # msgspec encodes the dataclass as json.dumps(asdict(r)) would, without asdict's
    # deep copy of every token time (most of the writing time of a large run)
    encode = msgspec.json.Encoder().encode
    with paths["records"].open("wb") as f:
        for r in records:
            f.write(encode(r) + b"\n")
    if not plots:
        return {k: v for k, v in paths.items() if v.suffix != ".png"}
    per_req = [request_metrics(r) for r in records if r.ok]
    tbts_ms = [g * 1e3 for m in per_req for g in m.tbts_s]
    ttfts_ms = [m.ttft_s * 1e3 for m in per_req if m.ttft_s is not None]
    plot_cdfs(paths["tbt_cdf"], {"TBT": tbts_ms}, "time between tokens (ms)", "CDF of TBT")
    plot_cdfs(paths["ttft_cdf"], {"TTFT": ttfts_ms}, "time to first token (ms)", "CDF of TTFT")
    plot_tokens_over_time(paths["tokens_over_time"], records, iterations, t0)
    plot_iteration_tokens(paths["iteration_tokens"], iterations, t0)
    return paths


def format_table(summary: Mapping[str, Any]) -> str:
    """The run's summary as a console table (latencies in ms) plus throughput lines."""
    rows = []
    for key, label in LATENCY_ROWS:
        d = summary.get(key) or {}
        rows.append(
            [label, str(d.get("count", 0))]
            + [
                _fmt(None if d.get(p) is None else d[p] * 1e3)
                for p in ("mean", "p50", "p90", "p99", "max")
            ]
        )
    text = [_table(["metric (ms)", "n", "mean", "p50", "p90", "p99", "max"], rows)]
    tp = summary.get("throughput", {})
    text.append(
        f"requests: {summary.get('num_completed')}/{summary.get('num_requests')} completed, "
        f"{summary.get('num_errors')} errors, {summary.get('total_preemptions')} preemptions, "
        f"makespan {_fmt(summary.get('makespan_s'))} s"
    )
    text.append(
        f"throughput: {_fmt(tp.get('requests_per_s'), 3)} req/s, "
        f"{_fmt(tp.get('input_tokens_per_s'), 1)} input tok/s, "
        f"{_fmt(tp.get('output_tokens_per_s'), 1)} output tok/s"
    )
    gp = summary.get("goodput", {})
    if gp.get("slo_ttft_s") is not None or gp.get("slo_tbt_s") is not None:
        text.append(
            f"goodput (TTFT <= {_fmt(gp.get('slo_ttft_s'), 3)} s, own P99 TBT <= "
            f"{_fmt(gp.get('slo_tbt_s'), 3)} s): {gp.get('num_good')} good, "
            f"fraction {_fmt(gp.get('fraction'), 3)}, {_fmt(gp.get('requests_per_s'), 3)} req/s"
        )
    it = summary.get("iterations", {})
    if it.get("count"):
        text.append(
            f"iterations: {it['count']} ({it.get('num_mixed')} mixed, "
            f"{it.get('num_prefill_only')} prefill-only, {it.get('num_decode_only')} "
            f"decode-only), mean {_fmt(_get(it, ('duration_s', 'mean')) * 1e3)} ms, "
            f"busy {_fmt(it.get('busy_fraction'), 3)}"
        )
    pc = summary.get("prefix_cache") or {}
    if pc.get("queries"):
        line = (
            f"prefix cache: {pc['hits']}/{pc['queries']} prompt tokens hit "
            f"({_fmt(100 * pc['hit_rate'], 1)} %)"
        )
        if pc.get("preempted_queries"):
            line += (
                f", after preemption {pc['preempted_hits']}/{pc['preempted_queries']} "
                f"({_fmt(100 * pc['preempted_hit_rate'], 1)} %)"
            )
        ideal = (summary.get("workload") or {}).get("prefix_sharing", {}).get("ideal_hit_rate")
        if ideal is not None:
            line += f"; the trace's ideal (infinite cache): {_fmt(100 * ideal, 1)} %"
        text.append(line)
    for err in summary.get("errors", [])[:3]:
        text.append(f"error: {err}")
    return "\n".join(text)


# ---------------------------------------------------------------------------- comparison


def comparison_ratios(
    summaries: Mapping[str, Mapping[str, Any]], baseline: str
) -> dict[str, dict[str, float | None]]:
    """For each run and comparison row: run value / baseline value (None if undefined)."""
    if baseline not in summaries:
        raise ValueError(f"baseline={baseline!r} is not one of the runs {list(summaries)}")
    out: dict[str, dict[str, float | None]] = {}
    for name, s in summaries.items():
        row: dict[str, float | None] = {}
        for label, path, _, _ in COMPARISON_ROWS:
            v, b = _get(s, path), _get(summaries[baseline], path)
            row[label] = float(v) / float(b) if v is not None and b else None
        out[name] = row
    return out


def format_comparison(
    summaries: Mapping[str, Mapping[str, Any]], baseline: str | None = None
) -> str:
    """Side-by-side table of several named runs; with `baseline`, each other run also
    gets a "name/baseline" ratio column."""
    names = list(summaries)
    header = ["metric", *names]
    ratios = None
    if baseline is not None:
        ratios = comparison_ratios(summaries, baseline)
        header += [f"{n}/{baseline}" for n in names if n != baseline]
    rows = []
    for label, path, mult, _ in COMPARISON_ROWS:
        row = [label]
        for n in names:
            v = _get(summaries[n], path)
            row.append(_fmt(v if v is None or mult == 1.0 else v * mult))
        if ratios is not None:
            row += [_fmt(ratios[n][label]) for n in names if n != baseline]
        rows.append(row)
    return _table(header, rows)


def write_comparison(
    output_dir: str | Path,
    summaries: Mapping[str, Mapping[str, Any]],
    records: Mapping[str, Sequence[RequestRecord]],
    baseline: str | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write comparison.json (every run's summary, and ratios to `baseline` when given),
    comparison.txt (the side-by-side table) and overlaid CDFs of TBT and TTFT (unless
    `plots` is False)."""
    if not summaries:
        raise ValueError("summaries is empty: nothing to compare")
    if set(records) - set(summaries):
        raise ValueError(f"records names {sorted(set(records) - set(summaries))} have no summary")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "comparison_json": out / COMPARISON_JSON,
        "comparison_txt": out / COMPARISON_TXT,
        "tbt_cdf": out / COMPARE_TBT_CDF_PNG,
        "ttft_cdf": out / COMPARE_TTFT_CDF_PNG,
    }
    table = format_comparison(summaries, baseline)
    data: dict[str, Any] = {"runs": {k: dict(v) for k, v in summaries.items()}}
    if baseline is not None:
        data["baseline"] = baseline
        data["ratios"] = comparison_ratios(summaries, baseline)
    _write_json(paths["comparison_json"], data)
    paths["comparison_txt"].write_text(table + "\n")
    if not plots:
        return {k: v for k, v in paths.items() if v.suffix != ".png"}
    tbts: dict[str, list[float]] = {}
    ttfts: dict[str, list[float]] = {}
    for name in summaries:
        per_req = [request_metrics(r) for r in records.get(name, ()) if r.ok]
        tbts[name] = [g * 1e3 for m in per_req for g in m.tbts_s]
        ttfts[name] = [m.ttft_s * 1e3 for m in per_req if m.ttft_s is not None]
    plot_cdfs(paths["tbt_cdf"], tbts, "time between tokens (ms)", "CDF of TBT")
    plot_cdfs(paths["ttft_cdf"], ttfts, "time to first token (ms)", "CDF of TTFT")
    return paths


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[RequestRecord]]:
    """A run written by `write_run`: its summary and its request records."""
    d = Path(run_dir)
    for name in (SUMMARY_JSON, RECORDS_JSONL):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d / name} not found: is {d} a replay output directory?")
    summary = json.loads((d / SUMMARY_JSON).read_text())
    records = [
        RequestRecord(**json.loads(line))
        for line in (d / RECORDS_JSONL).read_text().splitlines()
        if line.strip()
    ]
    return summary, records
