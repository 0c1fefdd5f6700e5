"""`sarazmq simulate`: a trace (or synthetic workload) through the real scheduler, in
simulated time with iteration times from a latency model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import sim_engine_options
from sarazmq.cli.sim_disagg import (
    add_goodput,
    disagg_options,
    goodput_line,
    num_gpus,
    run_disaggregated,
)
from sarazmq.cli.sim_options import (
    fleet_line,
    latency_line,
    latency_source_options,
    load_latency,
    sim_config,
    sim_engine_line,
    sim_pipeline_line,
    sim_vocabulary,
)
from sarazmq.cli.workload_options import (
    TRACE_HELP,
    comparison_options,
    comparison_policies,
    prepare_workload,
    workload_options,
)
from sarazmq.config import EngineConfig
from sarazmq.replay.describe import format_header
from sarazmq.replay.metrics import RequestRecord, summarize
from sarazmq.replay.report import format_comparison, format_table, write_comparison, write_run
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sim.fleet import simulate_fleet
from sarazmq.sim.run import sim_run_settings, simulate_workload

_SIMULATE_HELP = (
    """Simulate serving TRACE: the real scheduler (policy, KV block manager, prefix cache)
in simulated time, each iteration as long as a latency model says. No model or
deployment is started.

The latency model is a `sarazmq profile` JSON (--profile: this machine's engine) or a
named GPU and model architecture (--gpu a100 --arch mistral-7b [--tp N]: Vidur's measured
tables where they exist, else a roofline). --pp N simulates N pipeline stages (the layers
split evenly, up to N micro-batches in flight, activations sent at --pp-link-gbs between
stages) and reports the pipeline bubble fraction (idle stage time / total stage time
while a micro-batch is in flight). The KV pool is --num-kv-blocks, or the
profile's engine pool, or the GPU's memory (90 %) less the bf16 weights. Writes the same
summary.json, requests.csv, iterations.csv, records.jsonl and plots as `replay` to
--output-dir and prints the same table; --compare sarathi,vllm,orca simulates each policy
(outputs in --output-dir/POLICY/) and writes the comparison.

"""
    + TRACE_HELP
)


@click.command(help=_SIMULATE_HELP)
@click.argument("trace")
@workload_options(retime=True)
@latency_source_options
@sim_engine_options
@comparison_options("simulate the same workload with each")
@disagg_options
@click.option(
    "--scale-to-fleet",
    is_flag=True,
    help="with --dp N: run the trace N times faster, so each replica sees the trace's own rate",
)
@click.option("--plots/--no-plots", default=True, show_default=True, help="write the PNG plots")
def simulate(trace: str, **kw: Any) -> None:
    """Simulate serving TRACE (help text: _SIMULATE_HELP)."""
    for opt in ("connect", "concurrency", "request_timeout"):
        if kw[opt] is not None:
            raise click.BadParameter(
                "a simulation has no deployment or client", param_hint=f"--{opt.replace('_', '-')}"
            )
    policies, comparing, baseline = comparison_policies(kw)
    if kw["disaggregate"] and comparing:
        raise click.BadParameter(
            "compare a disaggregated run with others by running each", param_hint="--compare"
        )
    if kw["tbt_slo"] and any(p != "sarathi" for p in policies):
        raise click.BadParameter(
            "the adaptive chunk is the sarathi policy's; simulate the others without it",
            param_hint="--tbt-slo",
        )

    latency, info = load_latency(kw)
    vocab, avoid = sim_vocabulary(kw, info)
    kw = {**kw, "model": "", "vocab_size": vocab, "avoid_ids": avoid}
    if kw["scale_to_fleet"]:
        kw["time_scale"] = (kw["time_scale"] or 1.0) / kw["data_parallel_size"]
    spec, requests, workload = prepare_workload(trace, kw)
    click.echo(format_header(workload))
    base = sim_config(kw, info, requests)
    click.echo(latency_line(info))
    out_dir = Path(kw["output_dir"])
    summaries: dict[str, dict[str, Any]] = {}
    records = {}
    for policy in policies:
        config = base.with_policy(policy)
        click.echo(sim_engine_line(config))
        run_dir = out_dir / policy if comparing else out_dir
        if kw["disaggregate"]:
            summary, recs = run_disaggregated(requests, kw, info, latency, run_dir, workload)
        elif config.data_parallel_size > 1:
            summary, recs = _simulate_fleet(requests, config, latency, info, kw, run_dir, workload)
        else:
            summary, recs = _simulate_one(requests, config, latency, info, kw, run_dir, workload)
        if comparing:
            click.echo(f"--- {policy}")
        click.echo(format_table(summary))
        if "pipeline" in summary:
            click.echo(sim_pipeline_line(summary["pipeline"]))
        if "fleet" in summary:
            click.echo(fleet_line(summary["fleet"]))
        if not kw["disaggregate"]:
            add_goodput(summary, recs, kw, num_gpus(config))
        if "slo_goodput" in summary:
            click.echo(goodput_line(summary["slo_goodput"]))
        click.echo(f"wrote {run_dir}/")
        summaries[policy] = summary
        records[policy] = recs
    if comparing:
        write_comparison(out_dir, summaries, records, baseline=baseline, plots=kw["plots"])
        click.echo(format_comparison(summaries, baseline))
        pngs = ", compare_*_cdf.png" if kw["plots"] else ""
        click.echo(f"wrote {out_dir}/comparison.json, comparison.txt{pngs}")


def _simulate_one(
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    latency: Any,
    info: dict[str, Any],
    kw: dict[str, Any],
    run_dir: Path,
    workload: dict[str, Any],
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One engine (one replica, maybe pipelined): simulate, summarize, write the run."""
    try:
        out = simulate_workload(
            requests, config, latency, overhead_s=info["overhead_s"], progress=kw["progress"]
        )
    except ValueError as e:
        raise click.ClickException(f"{config.scheduler.policy}: {e}") from None
    click.echo(
        f"simulated {out.sim_time_s:.1f} s ({out.num_iterations} iterations) in {out.wall_s:.1f} s",
        err=True,
    )
    summary = summarize(out.records, out.iterations, kw["slo_ttft"], kw["slo_tbt"])
    if out.pipeline is not None and out.pipeline.pp > 1:
        summary["pipeline"] = out.pipeline.to_dict()
    write_run(
        run_dir,
        summary,
        out.records,
        out.iterations,
        workload=workload,
        settings=sim_run_settings(config, info, out),
        plots=kw["plots"],
    )
    return summary, out.records


def _simulate_fleet(
    requests: Sequence[WorkloadRequest],
    config: EngineConfig,
    latency: Any,
    info: dict[str, Any],
    kw: dict[str, Any],
    run_dir: Path,
    workload: dict[str, Any],
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """--dp N replicas behind the router: simulate, summarize, write the run."""
    try:
        out = simulate_fleet(
            requests, config, latency, overhead_s=info["overhead_s"], progress=kw["progress"]
        )
    except ValueError as e:
        raise click.ClickException(f"{config.scheduler.policy}: {e}") from None
    click.echo(
        f"simulated {out.sim_time_s:.1f} s ({out.num_iterations} iterations on "
        f"{config.data_parallel_size} replicas) in {out.wall_s:.1f} s",
        err=True,
    )
    summary = out.summary(kw["slo_ttft"], kw["slo_tbt"])
    write_run(
        run_dir, summary, out.records, [], workload=workload,
        settings=sim_run_settings(config, info, out), plots=kw["plots"],
    )  # fmt: skip
    return summary, out.records
