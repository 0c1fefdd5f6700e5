"""`sarazmq replay`: replay a trace (or a synthetic workload) against a deployment."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

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
from sarazmq.replay.metrics import summarize
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
@engine_options
def replay(trace: str, **kw: Any) -> None:
    """Replay TRACE against a deployment and report Sarathi-Serve's metrics (help text:
    _REPLAY_HELP)."""
    policies, comparing, baseline = comparison_policies(kw)
    if comparing and (kw["connect"] or kw["openai_url"]):
        raise click.BadParameter(
            "--compare starts a fresh deployment per policy; it cannot use --connect or "
            "--openai-url (compare another server with two replays and `sarazmq replay-diff`)",
            param_hint="--compare",
        )
    if kw["connect"] and kw["openai_url"]:
        raise click.BadParameter("give --connect or --openai-url, not both", param_hint="--connect")

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
                out = run_workload(endpoint, requests, kw, policy if comparing else "replay")
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
