"""`sarazmq sweep`: the chunk-size x long-prompt-share x load grid on real deployments
(or in the simulator), one row per point, resumable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import engine_config, engine_options
from sarazmq.cli.sim_options import (
    latency_line,
    latency_source_options,
    load_latency,
    refuse_several_instances,
    sim_config,
    sim_vocabulary,
)
from sarazmq.cli.sweep_backends import machine_probe, real_backend_of, run_dtype, sim_backend_of
from sarazmq.cli.workload_options import parse_policies
from sarazmq.sweep.grid import DEFAULT_CHUNK, DEFAULT_CHUNKS, DEFAULT_SHARES, SweepGrid
from sarazmq.sweep.mix import (
    DEFAULT_LONG_TRACE,
    DEFAULT_SHORT_TRACE,
    LengthSource,
    MixSpec,
    build_mixed_workload,
)
from sarazmq.sweep.report import format_best_chunks
from sarazmq.sweep.runner import capacities, run_sweep
from sarazmq.sweep.store import POINTS_CSV, POINTS_JSONL, SWEEP_JSON, SweepFileError

_HELP = f"""Run a grid of policies x chunk sizes x long-prompt shares x loads (x seeds), one
row per point: output/total tokens/s, TTFT and TBT P50/P95/P99, TPOT P50, decode stall
(P99 of each request's longest TBT; total of the TBT gaps > 2x the point's median), busy
fraction, MFU/MBU (iteration FLOPs/bytes against the machine probe), preemptions, SLO
attainment and goodput.

A point's workload: --num-requests requests, each long with probability SHARE, Poisson
arrivals. Short lengths from --short-trace (Azure conversation), long from --long-trace
(arXiv summarisation), fitted by --length-scale and --max-input/output-tokens; or fixed
with --short-input / --long-input / --output-tokens. Same seed, same workload.

Load: --qps 0.5,1 (req/s), or --load 0.5,0.9: fractions of each share's capacity, given
(--capacity-qps) or measured once (the share's workload sent all at once to the first
policy at chunk {DEFAULT_CHUNK}: completed requests / makespan), kept in
OUTDIR/capacity.json (delete it to measure again).

orca, fastertransformer and vllm (budget max(chunk, max_model_len)) schedule the same
for every chunk: they run once per (share, load, seed), chunk 'any'. Real mode starts one
deployment per (policy, chunk) (--scheduler/--chunk-size are ignored) and reuses it,
emptying its prefix cache between points; --simulate runs the simulator instead.

Resumable: each point is appended to OUTDIR/{POINTS_JSONL} when done; a rerun skips the
keys there (and refuses a folder of another workload). Then {POINTS_CSV}, {SWEEP_JSON},
plots and the best chunk per share. The machine is probed at start and end; points run
while it moved by > 15 % are flagged machine_changed."""

_QUICK = {"chunks": "64,256", "shares": "0,0.5", "num_requests": 8, "load": "0.5"}


def _numbers(text: str, option: str, cast: Callable[[str], Any]) -> tuple[Any, ...]:
    try:
        return tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: not a list", param_hint=option) from None


def _source(trace: str, fixed_input: int | None, output: int | None, name: str) -> LengthSource:
    if fixed_input is not None:
        if output is None:
            raise click.BadParameter(
                f"--{name}-input needs --output-tokens", param_hint="--output-tokens"
            )
        return LengthSource(input_tokens=fixed_input, output_tokens=output)
    if not Path(trace).is_file():
        raise click.BadParameter(f"{trace} is not a file", param_hint=f"--{name}-trace")
    return LengthSource(trace_path=trace)


def _mix(kw: dict[str, Any], vocab: int, avoid: tuple[int, ...]) -> MixSpec:
    if kw["output_tokens"] is not None and kw["short_input"] is None and kw["long_input"] is None:
        raise click.BadParameter(
            "needs --short-input and/or --long-input", param_hint="--output-tokens"
        )
    try:
        return MixSpec(
            vocab_size=vocab,
            avoid_ids=avoid,
            short=_source(kw["short_trace"], kw["short_input"], kw["output_tokens"], "short"),
            long=_source(kw["long_trace"], kw["long_input"], kw["output_tokens"], "long"),
            num_requests=kw["num_requests"],
            length_scale=kw["length_scale"],
            max_input_tokens=kw["max_input_tokens"],
            max_output_tokens=kw["max_output_tokens"],
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _model_config(model: str) -> Any:
    from sarazmq.model.loader import load_model_config, resolve_model

    try:
        return load_model_config(resolve_model(model))
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(f"--model: {e}") from None


@click.command(help=_HELP)
@click.option(
    "--policies", default="sarathi,vllm", show_default=True, help="comma-separated policies"
)
@click.option(
    "--chunks",
    default=None,
    help=f"comma-separated chunk sizes [default: {','.join(map(str, DEFAULT_CHUNKS))}]",
)
@click.option(
    "--shares",
    default=None,
    help=f"long-prompt shares [default: {','.join(f'{s:g}' for s in DEFAULT_SHARES)}]",
)
@click.option("--qps", "qps_list", default=None, help="comma-separated arrival rates (req/s)")
@click.option(
    "--load", "load_list", default=None, help="comma-separated fractions of each share's capacity"
)
@click.option(
    "--capacity-qps",
    type=float,
    default=None,
    help="the capacity --load is a fraction of (default: measured)",
)
@click.option(
    "--seeds",
    type=int,
    default=1,
    show_default=True,
    help="repeat every point with this many workload seeds (--seed, --seed+1, ...)",
)
@click.option("--num-requests", type=int, default=None, help="requests per point [default: 100]")
@click.option("--short-trace", default=str(DEFAULT_SHORT_TRACE), show_default=True)
@click.option("--long-trace", default=str(DEFAULT_LONG_TRACE), show_default=True)
@click.option("--short-input", type=int, default=None, help="fixed short prompt length")
@click.option("--long-input", type=int, default=None, help="fixed long prompt length")
@click.option("--output-tokens", type=int, default=None, help="fixed output length")
@click.option(
    "--length-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="multiply trace lengths (before clipping)",
)
@click.option("--max-input-tokens", type=int, default=None, help="clip prompts to this")
@click.option("--max-output-tokens", type=int, default=None, help="clip outputs to this")
@click.option(
    "--vocab-size",
    type=int,
    default=0,
    show_default=True,
    help="prompt ids are drawn below this (0: the --model's vocabulary)",
)
@click.option(
    "--avoid-ids",
    default="auto",
    show_default=True,
    help="ids never put in prompts ('auto': the tokenizer's special tokens)",
)
@click.option("--slo-ttft", type=float, default=None, help="a request's TTFT SLO (s)")
@click.option("--slo-tbt", type=float, default=None, help="a request's P99 TBT SLO (s)")
@click.option(
    "--output-dir", type=click.Path(file_okay=False), default="sweep_out", show_default=True
)
@click.option(
    "--keep-runs/--no-keep-runs",
    default=None,
    help="write each point's run under OUTDIR/points/KEY/ [default: on; off with --simulate]",
)
@click.option(
    "--quick", is_flag=True, help="a tiny grid: chunks 64,256, shares 0,0.5, 8 requests, --load 0.5"
)
@click.option(
    "--probe/--no-probe",
    "do_probe",
    default=True,
    show_default=True,
    help="probe the machine (GEMM, bandwidth) at start and end (never with --simulate)",
)
@click.option(
    "--simulate",
    is_flag=True,
    help="run the simulator (with --profile, or --gpu and --arch) instead of deployments",
)
@latency_source_options
@click.option("--concurrency", type=int, default=None, help="at most this many in flight")
@click.option("--request-timeout", type=float, default=None, help="per-request deadline (s)")
@click.option("--progress/--no-progress", default=False, show_default=True)
@engine_options
def sweep(**kw: Any) -> None:
    """Run the sweep grid (help text: _HELP)."""
    if kw["quick"]:
        for name, value in _QUICK.items():
            if name == "load":
                if kw["qps_list"] is None and kw["load_list"] is None:
                    kw["load_list"] = value
            elif kw[name] is None:
                kw[name] = value
    kw["num_requests"] = kw["num_requests"] or 100
    for name in ("slo_ttft", "slo_tbt", "capacity_qps"):
        if kw[name] is not None and not kw[name] > 0:
            raise click.BadParameter("must be > 0", param_hint=f"--{name.replace('_', '-')}")
    if (kw["qps_list"] is None) == (kw["load_list"] is None):
        raise click.BadParameter("give exactly one of --qps and --load", param_hint="--qps")
    if kw["capacity_qps"] is not None and kw["load_list"] is None:
        raise click.BadParameter("only with --load", param_hint="--capacity-qps")
    if kw["seeds"] < 1:
        raise click.BadParameter("must be >= 1", param_hint="--seeds")
    if kw["simulate"] != any(kw[k] is not None for k in ("profile", "gpu", "arch")):
        raise click.BadParameter(
            "--simulate needs --profile (or --gpu and --arch), and they need --simulate",
            param_hint="--simulate",
        )
    policies = parse_policies(kw["policies"], "--policies")
    chunks = _numbers(kw["chunks"] or ",".join(map(str, DEFAULT_CHUNKS)), "--chunks", int)
    shares = _numbers(kw["shares"] or ",".join(map(str, DEFAULT_SHARES)), "--shares", float)
    loads = _numbers(kw["qps_list"] or kw["load_list"], "--qps/--load", float)
    out_dir = Path(kw["output_dir"])
    from sarazmq.replay.vocabulary import prompt_vocabulary

    latency = info = None
    vocab, avoid_text = kw["vocab_size"], kw["avoid_ids"]
    if kw["simulate"]:
        latency, info = load_latency(kw)
        click.echo(latency_line(info))
        vocab, avoid_text = sim_vocabulary(kw, info)
    try:
        vocab, avoid = prompt_vocabulary(
            kw["model"], vocab, avoid_text, kw.get("load_format", "auto")
        )
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    mix = _mix(kw, vocab, tuple(avoid))
    seeds = tuple(kw["seed"] + i for i in range(kw["seeds"]))
    model_config = None if kw["arch"] else _model_config(kw["model"])
    sim_base = None
    # every request of any share is its seed's short or long draw: shares 0 and 1 hold
    # the longest requests of the grid
    reps = [
        r
        for seed in seeds
        for share in (0.0, 1.0)
        for r in build_mixed_workload(mix, share=share, qps=1.0, seed=seed)
    ]
    if kw["simulate"]:
        refuse_several_instances(kw, "a sweep")
        sim_base = sim_config(kw, info or {}, reps)
        max_model_len = sim_base.scheduler.max_model_len
    else:
        max_model_len = kw["max_model_len"] or model_config.max_position
    over = sum(1 for r in reps if r.input_tokens + r.output_tokens > max_model_len)
    if over:
        click.echo(
            f"warning: requests exceed max_model_len={max_model_len} (prompt + output; "
            f"{over} of {len(reps)} at shares 0 and 1) and will fail; clip with "
            "--max-input-tokens/--max-output-tokens",
            err=True,
        )
    try:
        grid = SweepGrid(
            policies=tuple(policies),
            chunks=chunks,
            shares=shares,
            loads=loads,
            load_kind="qps" if kw["qps_list"] is not None else "capacity",
            seeds=seeds,
            max_model_len=max_model_len,
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if kw["simulate"]:
        backend, settings = sim_backend_of(kw, latency, info or {}, sim_base, model_config)
    else:
        backend, settings = real_backend_of(kw, engine_config(kw), model_config)
    caps = None
    try:
        if grid.load_kind == "capacity":
            if kw["capacity_qps"] is not None:
                caps = {s: kw["capacity_qps"] for s in grid.shares}
            else:
                chunk = DEFAULT_CHUNK if DEFAULT_CHUNK in grid.chunks else grid.chunks[0]
                caps = capacities(
                    out_dir,
                    backend,
                    mix,
                    grid.shares,
                    policies[0],
                    chunk,
                    grid.seeds[0],
                    echo=click.echo,
                )
        data = run_sweep(
            grid,
            mix,
            out_dir,
            backend,
            settings,
            caps=caps,
            probe=machine_probe(kw["do_probe"] and not kw["simulate"], run_dtype(kw)),
            echo=click.echo,
        )
    except SweepFileError as e:
        raise click.ClickException(str(e)) from None
    except click.ClickException:
        raise
    except Exception as e:  # noqa: BLE001 - a failed deployment ends the command cleanly
        raise click.ClickException(f"{type(e).__name__}: {e}") from None
    click.echo(format_best_chunks(data["best_chunks"], kw["slo_tbt"]))
    if any(p.get("machine_changed") for p in data["points"]):
        click.echo("* points run while the machine probe moved by > 15 % (machine_changed)")
    click.echo(f"wrote {out_dir}/{POINTS_CSV}, {SWEEP_JSON}, plots")
