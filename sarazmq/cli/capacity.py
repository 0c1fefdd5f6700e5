"""`sarazmq capacity`: each policy's highest request rate that meets the SLOs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import engine_config, engine_options
from sarazmq.cli.runs import engine_line, run_settings, run_workload
from sarazmq.cli.sim_capacity import SimProbes
from sarazmq.cli.sim_options import latency_source_options
from sarazmq.cli.workload_options import (
    TRACE_HELP,
    parse_policies,
    prepare_workload,
    workload_options,
)
from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.replay.capacity import (
    CAPACITY_JSON,
    CAPACITY_TXT,
    CapacityProbe,
    CapacityResult,
    capacity_ratios,
    find_capacity,
    format_capacity,
)
from sarazmq.replay.describe import describe, format_header
from sarazmq.replay.driver import target
from sarazmq.replay.metrics import summarize
from sarazmq.replay.report import write_run
from sarazmq.replay.workload import WorkloadSpec, build_workload

_CAPACITY_HELP = (
    """Find each policy's capacity on TRACE: the highest request rate at which P99 TBT <=
--slo-tbt and median scheduling delay <= --slo-sched-delay (Sarathi-Serve's definition).

The trace's requests (lengths, prompts) are re-timed as a Poisson (or gamma) process
at each probed rate: --lo-qps, then --hi-qps raised by --growth while it passes, then
bisection until the bracket is within --rel-tol, at most --max-probes replays per
policy. Each policy gets one fresh deployment (--scheduler is ignored; use --policies),
reused across its probes. Writes capacity.json/.txt (capacity per policy and the ratio
to --baseline) and every probe's run under --output-dir/POLICY/qps-RATE/.
With --simulate no deployment is started: every probe is a `sarazmq simulate` run
(--profile, or --gpu and --arch with --tp; no plots are written per probe).

"""
    + TRACE_HELP
)


def _probe_line(policy: str, p: CapacityProbe) -> str:
    tbt = "-" if p.tbt_p99_s is None else f"{p.tbt_p99_s * 1e3:.0f} ms"
    sd = "-" if p.sched_delay_p50_s is None else f"{p.sched_delay_p50_s * 1e3:.0f} ms"
    verdict = "pass" if p.ok else f"FAIL ({p.reason})"
    return f"  {policy} @ {p.qps:.4g} req/s: P99 TBT {tbt}, median sched delay {sd}: {verdict}"


def _probe_runner(
    spec: WorkloadSpec,
    endpoint: str,
    engine: Mapping[str, Any],
    kw: Mapping[str, Any],
    policy: str,
    out_dir: Path,
) -> Callable[[float], dict[str, Any]]:
    """The capacity search's run_at_qps for one deployment: replays `spec` re-timed at
    the probed rate, writes the probe's run under out_dir/POLICY/qps-RATE/ and returns
    its summary."""
    probed: list[float] = []

    def run_at_qps(qps: float) -> dict[str, Any]:
        probe_spec = dataclasses.replace(spec, qps=qps)
        requests = build_workload(probe_spec)
        # one warm-up per deployment: later probes find it warm
        out = run_workload(endpoint, requests, kw, f"{policy} @ {qps:.3g}/s", warmup=not probed)
        probed.append(qps)
        summary = summarize(out.records, out.iterations)
        write_run(
            out_dir / policy / f"qps-{qps:.4g}",
            summary,
            out.records,
            out.iterations,
            workload=describe(probe_spec, requests, block_size=kw["block_size"]),
            settings=run_settings(out, engine),
        )
        return summary

    return run_at_qps


@contextlib.contextmanager
def _probes(
    sim: SimProbes | None,
    config: EngineConfig | None,
    spec: WorkloadSpec,
    kw: Mapping[str, Any],
    policy: str,
    out_dir: Path,
) -> Iterator[Callable[[float], dict[str, Any]]]:
    """One policy's run_at_qps: simulated, or on a deployment of `config` started for its
    probes (or the one at --connect)."""
    if sim is not None:
        yield sim.runner(spec, kw, policy, out_dir)
        return
    with target(
        kw["connect"], config, DeploymentConfig(num_detokenizers=kw["num_detokenizers"])
    ) as (endpoint, engine):
        yield _probe_runner(spec, endpoint, engine, kw, policy, out_dir)


@click.command(help=_CAPACITY_HELP)
@click.argument("trace")
@workload_options(retime=False)
@click.option("--slo-tbt", type=float, required=True, help="P99 TBT SLO (seconds)")
@click.option(
    "--slo-sched-delay",
    type=float,
    required=True,
    help="median scheduling-delay SLO (seconds)",
)
@click.option(
    "--policies", default="sarathi,vllm", show_default=True, help="comma-separated policies"
)
@click.option("--baseline", default=None, help="ratio reference (default: vllm when searched)")
@click.option("--lo-qps", type=float, default=0.05, show_default=True, help="first probe")
@click.option(
    "--hi-qps",
    type=float,
    default=0.2,
    show_default=True,
    help="second probe (raised while it passes)",
)
@click.option("--max-qps", type=float, default=None, help="never probe above this rate")
@click.option("--max-probes", type=int, default=6, show_default=True, help="probes per policy")
@click.option(
    "--rel-tol",
    type=float,
    default=0.1,
    show_default=True,
    help="stop when the bracket is this tight",
)
@click.option("--growth", type=float, default=2.0, show_default=True)
@click.option(
    "--simulate",
    is_flag=True,
    help="simulate every probe (real scheduler, simulated time) instead of a deployment",
)
@latency_source_options
@engine_options
def capacity(trace: str, **kw: Any) -> None:
    """Search each policy's capacity on TRACE (help text: _CAPACITY_HELP)."""
    policies = parse_policies(kw["policies"], "--policies")
    if kw["connect"] and len(policies) > 1:
        raise click.BadParameter(
            "with --connect there is one deployment: give one policy (its own)",
            param_hint="--policies",
        )
    baseline = kw["baseline"] or ("vllm" if "vllm" in policies else None)
    if baseline is not None and baseline not in policies:
        raise click.BadParameter(f"{baseline!r} is not among {policies}", param_hint="--baseline")
    kw = {**kw, "qps": kw["lo_qps"]}  # a valid rate for the header; each probe sets its own
    if not kw["simulate"] and (kw["profile"] or kw["gpu"] or kw["arch"]):
        raise click.BadParameter("--profile/--gpu/--arch need --simulate", param_hint="--simulate")
    sim = SimProbes(kw) if kw["simulate"] else None
    if sim is not None:
        kw = sim.workload_kw(kw)
    spec, requests, info = prepare_workload(trace, kw)
    click.echo(format_header(info))
    click.echo("(arrival times above are at --lo-qps; each probe re-times them at its rate)")
    out_dir = Path(kw["output_dir"])
    if sim is not None:
        sim.set_workload(kw, requests)
    results: dict[str, CapacityResult] = {}
    for policy in policies:
        run_kw = {**kw, "scheduler": policy}
        if sim is not None:
            click.echo(sim.engine_line(run_kw, policy))
        else:
            click.echo(
                engine_line(run_kw, policy) if not kw["connect"] else f"target: {kw['connect']}"
            )
        config = None if kw["connect"] or sim else engine_config(run_kw)
        try:
            with _probes(sim, config, spec, kw, policy, out_dir) as run_at_qps:
                result = find_capacity(
                    run_at_qps,
                    kw["slo_tbt"],
                    kw["slo_sched_delay"],
                    kw["lo_qps"],
                    kw["hi_qps"],
                    kw["max_probes"],
                    rel_tol=kw["rel_tol"],
                    growth=kw["growth"],
                    max_qps=kw["max_qps"],
                    on_probe=lambda p, policy=policy: click.echo(_probe_line(policy, p)),
                )
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a failed deployment ends the command cleanly
            raise click.ClickException(f"{policy}: {type(e).__name__}: {e}") from None
        results[policy] = result
        click.echo(format_capacity({policy: result}, None))
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "slo_tbt_p99_s": kw["slo_tbt"],
        "slo_sched_delay_p50_s": kw["slo_sched_delay"],
        "baseline": baseline,
        "results": {k: v.to_dict() for k, v in results.items()},
        "ratios": capacity_ratios(results, baseline),
        "workload": info,
    }
    (out_dir / CAPACITY_JSON).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    table = format_capacity(results, baseline)
    (out_dir / CAPACITY_TXT).write_text(table + "\n")
    click.echo(table)
    click.echo(f"wrote {out_dir}/{CAPACITY_JSON}, {CAPACITY_TXT}")
