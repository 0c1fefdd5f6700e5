"""`sarazmq simulate`: a trace (or synthetic workload) through the real scheduler, in
simulated time with iteration times from a latency model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sarazmq.cli.sim_options import (
    latency_line,
    latency_source_options,
    load_latency,
    pipeline_line,
    sim_engine_line,
    sim_geometry,
    sim_scheduling_options,
    sim_settings,
    sim_vocabulary,
)
from sarazmq.cli.workload_options import (
    TRACE_HELP,
    comparison_options,
    comparison_policies,
    prepare_workload,
    workload_options,
)
from sarazmq.replay.describe import format_header
from sarazmq.replay.metrics import summarize
from sarazmq.replay.report import format_comparison, format_table, write_comparison, write_run
from sarazmq.sim.run import simulate_workload

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
@latency_source_options(tp=True)
@sim_scheduling_options
@comparison_options("simulate the same workload with each")
@click.option("--plots/--no-plots", default=True, show_default=True, help="write the PNG plots")
def simulate(trace: str, **kw: Any) -> None:
    """Simulate serving TRACE (help text: _SIMULATE_HELP)."""
    for opt in ("connect", "concurrency", "request_timeout"):
        if kw[opt] is not None:
            raise click.BadParameter(
                "a simulation has no deployment or client", param_hint=f"--{opt.replace('_', '-')}"
            )
    policies, comparing, baseline = comparison_policies(kw)
    if kw["tbt_slo"] and any(p != "sarathi" for p in policies):
        raise click.BadParameter(
            "the adaptive chunk is the sarathi policy's; simulate the others without it",
            param_hint="--tbt-slo",
        )

    latency, info = load_latency(kw)
    vocab, avoid = sim_vocabulary(kw, info)
    kw = {**kw, "model": "", "vocab_size": vocab, "avoid_ids": avoid}
    spec, requests, workload = prepare_workload(trace, kw)
    click.echo(format_header(workload))
    geometry = sim_geometry(kw, info, requests)
    click.echo(latency_line(info))
    out_dir = Path(kw["output_dir"])
    summaries: dict[str, dict[str, Any]] = {}
    records = {}
    for policy in policies:
        click.echo(sim_engine_line(kw, policy, geometry))
        try:
            out = simulate_workload(
                requests,
                {**kw, "scheduler": policy},
                latency,
                **geometry,
                seed=kw["seed"],
                overhead_s=info["overhead_s"],
                progress=kw["progress"],
            )
        except ValueError as e:
            raise click.ClickException(f"{policy}: {e}") from None
        click.echo(
            f"simulated {out.sim_time_s:.1f} s ({out.num_iterations} iterations) in "
            f"{out.wall_s:.1f} s",
            err=True,
        )
        summary = summarize(out.records, out.iterations, kw["slo_ttft"], kw["slo_tbt"])
        pipelined = out.pipeline is not None and out.pipeline.pp > 1
        if pipelined:
            summary["pipeline"] = out.pipeline.to_dict()
        run_dir = out_dir / policy if comparing else out_dir
        write_run(
            run_dir,
            summary,
            out.records,
            out.iterations,
            workload=workload,
            settings=sim_settings(kw, policy, geometry, info, out),
            plots=kw["plots"],
        )
        if comparing:
            click.echo(f"--- {policy}")
        click.echo(format_table(summary))
        if pipelined:
            click.echo(pipeline_line(out))
        click.echo(f"wrote {run_dir}/")
        summaries[policy] = summary
        records[policy] = out.records
    if comparing:
        write_comparison(out_dir, summaries, records, baseline=baseline, plots=kw["plots"])
        click.echo(format_comparison(summaries, baseline))
        pngs = ", compare_*_cdf.png" if kw["plots"] else ""
        click.echo(f"wrote {out_dir}/comparison.json, comparison.txt{pngs}")
