"""Running a workload on a deployment for `replay` and `capacity`: the run and its warnings."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import click

from sarazmq.replay.driver import OnRecord, ReplayOutcome, clock_check, replay_detailed
from sarazmq.replay.openai_driver import replay_openai
from sarazmq.replay.workload import WorkloadRequest

#: A request sent this much later than due means the arrival process was not honoured.
SEND_LAG_WARN_S = 0.25


def engine_line(kw: Mapping[str, Any], policy: str) -> str:
    return (
        f"engine: {kw['model']}  scheduler: {policy}  chunk: {kw['chunk_size']}  "
        f"max_num_seqs: {kw['max_num_seqs']}  dtype: {kw['dtype']}  "
        f"tp: {kw['tensor_parallel_size']}  "
        f"kv blocks: {kw['num_kv_blocks'] or 'auto'}  max_model_len: {kw['max_model_len'] or 'auto'}"
        + (f"  tbt-slo: {kw['tbt_slo']} s (chunk = upper bound)" if kw.get("tbt_slo") else "")
    )


def check_fit(requests: Sequence[WorkloadRequest], engine: Mapping[str, Any]) -> None:
    """Warns when a request cannot reach its output length on the started deployment."""
    sched = engine.get("scheduler")
    if not isinstance(sched, Mapping) or not sched.get("max_model_len"):
        return
    limit = int(sched["max_model_len"])
    over = sum(1 for r in requests if r.input_tokens + r.output_tokens > limit)
    if over:
        click.echo(
            f"warning: {over} request(s) exceed max_model_len={limit} (prompt + output) and "
            "will stop short or be rejected; clip with --max-input-tokens/--max-output-tokens",
            err=True,
        )


def run_workload(
    endpoint: str,
    requests: Sequence[WorkloadRequest],
    kw: Mapping[str, Any],
    description: str,
    *,
    warmup: bool = True,
    on_record: OnRecord | None = None,
) -> ReplayOutcome:
    """Replays `requests` against a ZeroMQ endpoint, or (kw["openai_url"]) through an
    OpenAI-compatible server's streaming API; warns about clocks and send lag.
    on_record: sees each request's record as it ends (ZeroMQ endpoints only)."""
    common = {
        "progress": kw["progress"],
        "concurrency_limit": kw["concurrency"],
        "temperature": kw["temperature"],
        "seed": kw["seed"],
        "timeout": kw["request_timeout"],
        "description": description,
        "warmup": warmup,
    }
    if kw.get("openai_url"):
        out = asyncio.run(
            replay_openai(
                kw["openai_url"], kw["model"], requests, api_key=kw.get("openai_api_key"), **common
            )
        )
    else:
        out = asyncio.run(replay_detailed(endpoint, requests, on_record=on_record, **common))
    warning = clock_check(out.records)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    if out.max_send_lag_s > SEND_LAG_WARN_S and kw["concurrency"] is None:
        click.echo(
            f"warning: a request was sent {out.max_send_lag_s:.2f} s after it was due (the "
            "client was too busy); arrivals are recorded as actual send times",
            err=True,
        )
    return out


def run_settings(out: ReplayOutcome, engine: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **out.settings,
        "engine": dict(engine),
        "wall_s": out.wall_s,
        "max_send_lag_s": out.max_send_lag_s,
    }


def adaptive_summary(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """The adaptive budget's figures at the end of a run (None without --tbt-slo): the
    target, the latency model's out-of-sample error and margin, the mean chunk."""
    end = settings.get("server_stats_at_end") or {}
    if not end.get("tbt_slo"):
        return None
    keys = (
        "tbt_slo",
        "latency_model_samples",
        "latency_model_mape",
        "latency_model_p95_error",
        "latency_model_margin",
        "budget_mean_chunk",
        "budget_limited_iterations",
        "budget_min_chunk_iterations",
    )
    return {k: end.get(k, 0) for k in keys}


def pipeline_summary(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pipeline's figures at the end of a run (None with one stage): stages, the
    bubble fraction and each stage's busy seconds, over the deployment's life."""
    end = settings.get("server_stats_at_end") or {}
    if end.get("pipeline_parallel_size", 1) <= 1:
        return None
    keys = ("pipeline_parallel_size", "bubble_fraction", "active_s", "stage_busy_s")
    return {k: end.get(k) for k in keys}


def pipeline_line(pipeline: Mapping[str, Any]) -> str:
    active = pipeline["active_s"] or 0.0
    shares = ", ".join(f"{b / active:.2f}" if active else "-" for b in pipeline["stage_busy_s"])
    return (
        f"pipeline: {pipeline['pipeline_parallel_size']} stages, bubble fraction "
        f"{pipeline['bubble_fraction']:.3f}, stage busy shares {shares}"
    )


def adaptive_line(budget: Mapping[str, Any]) -> str:
    return (
        f"adaptive budget: TBT target {budget['tbt_slo'] * 1e3:.0f} ms, mean chunk "
        f"{budget['budget_mean_chunk']:.0f} tokens, latency model error MAPE "
        f"{budget['latency_model_mape'] * 100:.1f} % / P95 {budget['latency_model_p95_error'] * 100:.1f} % "
        f"over {budget['latency_model_samples']} iterations (margin {budget['latency_model_margin']:.2f})"
    )
