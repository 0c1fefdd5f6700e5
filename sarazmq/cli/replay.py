"""`sarazmq replay`: replay a trace (or a synthetic workload) against a deployment."""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any

import click

from sarazmq.api import DashboardServer
from sarazmq.cli.options import engine_config, engine_options
from sarazmq.cli.runs import (
    adaptive_line,
    adaptive_summary,
    check_fit,
    engine_line,
    pipeline_line,
    pipeline_summary,
    run_settings,
    run_workload,
)
from sarazmq.cli.workload_options import (
    TRACE_HELP,
    comparison_options,
    comparison_policies,
    prepare_workload,
    workload_options,
)
from sarazmq.config import DeploymentConfig
from sarazmq.replay.describe import format_header
from sarazmq.replay.driver import target
from sarazmq.replay.metrics import RequestRecord, summarize
from sarazmq.replay.report import format_comparison, format_table, write_comparison, write_run

_REPLAY_HELP = (
    """Replay TRACE against a deployment and report Sarathi-Serve's metrics.

Without --connect a deployment is started for the run (engine options below) and torn
down after it. Writes summary.json, requests.csv, iterations.csv and PNG plots (CDFs of
TBT and TTFT, tokens over time, prefill/decode tokens per iteration) to --output-dir,
and prints a table. With --compare sarathi,vllm,orca the same workload runs against a
fresh deployment of each policy (outputs in --output-dir/POLICY/), then
comparison.json/.txt and overlaid CDFs are written, with ratios to --baseline.

"""
    + TRACE_HELP
)


@click.command(help=_REPLAY_HELP)
@click.argument("trace")
@workload_options(retime=True)
@comparison_options("replay the same workload against a fresh deployment of each")
@click.option(
    "--openai-url",
    default=None,
    help="replay through this OpenAI-compatible server (http://HOST:PORT/v1: ours, vLLM, "
    "...) instead of a sarazmq deployment; --model is the model name it serves",
)
@click.option("--openai-api-key", default=None, help="bearer key for --openai-url")
@click.option(
    "--dashboard",
    is_flag=True,
    help="serve the live dashboard (hybrid batches, queues, KV, latencies) of the "
    "deployment being replayed at http://127.0.0.1:--dashboard-port/dashboard while it runs",
)
@click.option("--dashboard-port", type=click.IntRange(1, 65535), default=8090, show_default=True)
@click.option(
    "--dashboard-linger",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="with --dashboard: seconds the page stays up after the last run",
)
@engine_options
def replay(trace: str, **kw: Any) -> None:
    """Replay TRACE against a deployment and report Sarathi-Serve's metrics (help text:
    _REPLAY_HELP)."""
    _, comparing, _ = comparison_policies(kw)
    if comparing and (kw["connect"] or kw["openai_url"]):
        raise click.BadParameter(
            "--compare starts a fresh deployment per policy; it cannot use --connect or "
            "--openai-url (compare another server with two replays and `sarazmq replay-diff`)",
            param_hint="--compare",
        )
    if kw["connect"] and kw["openai_url"]:
        raise click.BadParameter("give --connect or --openai-url, not both", param_hint="--connect")
    if kw["dashboard"] and kw["openai_url"]:
        raise click.BadParameter(
            "--dashboard watches a sarazmq deployment's scheduler; through --openai-url open "
            "that server's own /dashboard",
            param_hint="--dashboard",
        )
    with contextlib.ExitStack() as stack:
        dashboard = None
        if kw["dashboard"]:
            dashboard = DashboardServer(kw["dashboard_port"], kw["model"] or "sarazmq")
            try:
                stack.enter_context(dashboard)
            except OSError as e:
                raise click.ClickException(str(e)) from None
            click.echo(f"dashboard: {dashboard.url}")
        _replay(trace, kw, dashboard)
        if dashboard is not None and kw["dashboard_linger"] > 0:
            click.echo(f"dashboard: staying up {kw['dashboard_linger']:.0f} s", err=True)
            time.sleep(kw["dashboard_linger"])


def _replay(trace: str, kw: dict[str, Any], dashboard: DashboardServer | None) -> None:
    policies, comparing, baseline = comparison_policies(kw)

    spec, requests, info = prepare_workload(trace, kw)
    click.echo(format_header(info))
    out_dir = Path(kw["output_dir"])
    summaries: dict[str, dict[str, Any]] = {}
    records = {}
    remote = kw["connect"] or kw["openai_url"]
    for policy in policies:
        run_kw = {**kw, "scheduler": policy}
        click.echo(engine_line(run_kw, policy) if not remote else f"target: {remote}")
        config = None if remote else engine_config(run_kw)
        t0 = time.monotonic()
        try:
            with target(
                remote, config, DeploymentConfig(num_detokenizers=kw["num_detokenizers"])
            ) as (endpoint, engine):
                if not remote:
                    click.echo(f"deployment ready in {time.monotonic() - t0:.1f} s", err=True)
                check_fit(requests, engine)
                on_record = None
                if dashboard is not None:
                    dashboard.attach(endpoint, label=policy if not remote else remote)
                    on_record = functools.partial(_show_record, dashboard)
                out = run_workload(
                    endpoint,
                    requests,
                    kw,
                    policy if comparing else "replay",
                    on_record=on_record,
                )
        except Exception as e:  # noqa: BLE001 - a failed deployment ends the command cleanly
            raise click.ClickException(f"{policy}: {type(e).__name__}: {e}") from None
        summary = summarize(out.records, out.iterations, kw["slo_ttft"], kw["slo_tbt"])
        budget = adaptive_summary(out.settings)
        if budget is not None:
            summary["adaptive_budget"] = budget
        pipeline = pipeline_summary(out.settings)
        if pipeline is not None:
            summary["pipeline"] = pipeline
        run_dir = out_dir / policy if comparing else out_dir
        write_run(
            run_dir,
            summary,
            out.records,
            out.iterations,
            workload=info,
            settings=run_settings(out, engine),
        )
        if comparing:
            click.echo(f"--- {policy}")
        click.echo(format_table(summary))
        if budget is not None:
            click.echo(adaptive_line(budget))
        if pipeline is not None:
            click.echo(pipeline_line(pipeline))
        click.echo(f"wrote {run_dir}/")
        summaries[policy] = summary
        records[policy] = out.records
    if comparing:
        write_comparison(out_dir, summaries, records, baseline=baseline)
        click.echo(format_comparison(summaries, baseline))
        click.echo(f"wrote {out_dir}/comparison.json, comparison.txt, compare_*_cdf.png")


def _show_record(dashboard: DashboardServer, record: RequestRecord) -> None:
    """A replayed request ended: its latencies join the dashboard's window."""
    if record.ok and record.server_arrival_s is not None:
        dashboard.feed.observe_request(record.server_arrival_s, record.token_times_s)
