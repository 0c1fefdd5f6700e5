"""`sarazmq replay` and `sarazmq capacity`: the trace replay harness on the command line.

Registered on the `sarazmq` click group by sarazmq/cli.py; import this module through
`sarazmq.cli` (it takes the shared engine options from there).

TRACE is either a trace file or a keyword for a synthetic workload:

- a path: an Azure LLM inference trace CSV, a Mooncake JSONL trace or Sarathi-Serve's
  ShareGPT lengths CSV (the kind is read from the header; `--trace-kind` forces it).
  Lengths come from the trace; arrivals from its timestamps unless `--qps` re-times them.
- `fixed`: every request has `--input-tokens` / `--output-tokens`.
- `uniform` / `zipf`: lengths drawn from `--input-range` / `--output-range` (zipf: short
  lengths most frequent, exponent `--zipf-theta`).

A synthetic workload needs `--max-requests` and an arrival process (`--qps`, or
`--arrivals all_at_once`). To use a file literally named like a keyword, write `./fixed`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from sarazmq.cli import build_config, engine_options
from sarazmq.config import POLICIES
from sarazmq.replay.capacity import CapacityProbe, CapacityResult, find_capacity
from sarazmq.replay.driver import ReplayOutcome, clock_check, replay_detailed, target
from sarazmq.replay.metrics import summarize
from sarazmq.replay.report import format_comparison, format_table, write_comparison, write_run
from sarazmq.replay.traces import TRACE_KINDS
from sarazmq.replay.workload import (
    ARRIVAL_KINDS,
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
    describe,
    format_header,
)

SYNTHETIC = ("fixed", "uniform", "zipf")
CAPACITY_JSON = "capacity.json"
CAPACITY_TXT = "capacity.txt"
#: A request sent this much later than due means the arrival process was not honoured.
SEND_LAG_WARN_S = 0.25

_TRACE_HELP = """TRACE is a trace file (Azure LLM trace CSV, Mooncake JSONL, Sarathi's
ShareGPT lengths CSV; the kind is read from the header) or a synthetic workload:
'fixed' (--input-tokens, --output-tokens), 'uniform' or 'zipf' (--input-range,
--output-range, --zipf-theta). Synthetic workloads need --max-requests and an arrival
process (--qps, or --arrivals all_at_once). For a file named like a keyword write ./fixed.

Fitting flags apply in this order: rows (--start, --max-requests), lengths
(--length-scale, then clipping to --min/--max-input/output-tokens), arrivals (trace
times or --qps re-timing, then --time-scale). The header printed first shows the result.
Prompts are random token ids (never --avoid-ids) of exactly the input length, sent with
ignore_eos and max_tokens = the output length."""

_REPLAY_HELP = (
    """Replay TRACE against a deployment and report Sarathi-Serve's metrics.

Without --connect a deployment is started for the run (engine options below) and torn
down after it. Writes summary.json, requests.csv, iterations.csv and PNG plots (CDFs of
TBT and TTFT, tokens over time, prefill/decode tokens per iteration) to --output-dir,
and prints a table. With --compare sarathi,vllm,orca the same workload runs against a
fresh deployment of each policy (outputs in --output-dir/POLICY/), then
comparison.json/.txt and overlaid CDFs are written, with ratios to --baseline.

"""
    + _TRACE_HELP
)

_CAPACITY_HELP = (
    """Find each policy's capacity on TRACE: the highest request rate at which P99 TBT <=
--slo-tbt and median scheduling delay <= --slo-sched-delay (Sarathi-Serve's definition).

The trace's requests (lengths, prompts) are re-timed as a Poisson (or gamma) process
at each probed rate: --lo-qps, then --hi-qps raised by --growth while it passes, then
bisection until the bracket is within --rel-tol, at most --max-probes replays per
policy. Each policy gets one fresh deployment (--scheduler is ignored; use --policies),
reused across its probes. Writes capacity.json/.txt (capacity per policy and the ratio
to --baseline) and every probe's run under --output-dir/POLICY/qps-RATE/.

"""
    + _TRACE_HELP
)


# ---------------------------------------------------------------------------- options


def _workload_options(*, retime: bool) -> Callable[[Any], Any]:
    """Options that shape the workload. retime: add --qps / --time-scale and every
    arrival process (replay); without it the rate is the capacity search's to set."""

    def deco(f: Any) -> Any:
        opts = [
            click.option(
                "--trace-kind",
                type=click.Choice(("auto", *TRACE_KINDS)),
                default="auto",
                show_default=True,
                help="kind of the trace file (auto: from its header)",
            ),
            click.option(
                "--max-requests", type=int, default=None, help="use at most this many requests"
            ),
            click.option(
                "--start", type=int, default=0, show_default=True, help="first trace row used"
            ),
            click.option(
                "--max-input-tokens", type=int, default=None, help="clip prompts to this length"
            ),
            click.option(
                "--max-output-tokens", type=int, default=None, help="clip outputs to this length"
            ),
            click.option("--min-input-tokens", type=int, default=1, show_default=True),
            click.option("--min-output-tokens", type=int, default=1, show_default=True),
            click.option(
                "--length-scale",
                type=float,
                default=1.0,
                show_default=True,
                help="multiply input and output lengths (before clipping)",
            ),
            click.option(
                "--input-tokens", type=int, default=512, show_default=True, help="'fixed' only"
            ),
            click.option(
                "--output-tokens", type=int, default=128, show_default=True, help="'fixed' only"
            ),
            click.option(
                "--input-range",
                type=(int, int),
                default=(32, 1024),
                show_default=True,
                help="'uniform'/'zipf' prompt lengths LO HI (inclusive)",
            ),
            click.option(
                "--output-range",
                type=(int, int),
                default=(16, 256),
                show_default=True,
                help="'uniform'/'zipf' output lengths LO HI (inclusive)",
            ),
            click.option("--zipf-theta", type=float, default=1.1, show_default=True),
            click.option(
                "--prefix-sharing",
                is_flag=True,
                help="prompts share blocks as the trace's hash_ids say (Mooncake)",
            ),
            click.option("--seed", type=int, default=0, show_default=True),
            click.option(
                "--cv",
                type=float,
                default=1.0,
                show_default=True,
                help="coefficient of variation of gamma inter-arrival gaps",
            ),
        ]
        if retime:
            opts += [
                click.option(
                    "--qps",
                    type=float,
                    default=None,
                    help="re-time arrivals at this rate (Poisson, or gamma with --cv)",
                ),
                click.option(
                    "--arrivals",
                    type=click.Choice(ARRIVAL_KINDS),
                    default="auto",
                    show_default=True,
                    help="auto: poisson with --qps, else the trace's own times",
                ),
                click.option(
                    "--time-scale",
                    type=float,
                    default=1.0,
                    show_default=True,
                    help="multiply every inter-arrival gap (2 = half the rate)",
                ),
            ]
        else:
            opts.append(
                click.option(
                    "--arrivals",
                    type=click.Choice(("poisson", "gamma")),
                    default="poisson",
                    show_default=True,
                )
            )
        opts += [
            click.option(
                "--vocab-size",
                type=int,
                default=0,
                show_default=True,
                help="prompt ids are drawn below this (0: the --model's vocabulary)",
            ),
            click.option(
                "--avoid-ids",
                default="auto",
                show_default=True,
                help="ids never put in prompts, e.g. '0-16,100' ('auto': the --model "
                "tokenizer's special tokens; '' none)",
            ),
            click.option(
                "--connect",
                default=None,
                help="endpoint of a running deployment (on this machine: the server's "
                "timestamps are compared with this clock); default: start one",
            ),
            click.option(
                "--output-dir",
                type=click.Path(file_okay=False),
                default="replay_out",
                show_default=True,
            ),
            click.option(
                "--concurrency",
                type=int,
                default=None,
                help="at most this many requests in flight (default: no limit)",
            ),
            click.option(
                "--request-timeout",
                type=float,
                default=None,
                help="per-request deadline in seconds (a late request is an error)",
            ),
            click.option("--temperature", type=float, default=0.0, show_default=True),
            click.option("--progress/--no-progress", default=True, show_default=True),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f

    return deco


# ---------------------------------------------------------------------------- helpers


def parse_id_ranges(text: str) -> tuple[int, ...]:
    """'0-16,100' -> (0, 1, ..., 16, 100). Raises ValueError naming the bad part."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"--avoid-ids: {part!r} is not an id or a range LO-HI") from None
        if a < 0 or b < a:
            raise ValueError(f"--avoid-ids: {part!r} must be ids >= 0 with LO <= HI")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def prompt_vocabulary(model: str, vocab_size: int, avoid: str) -> tuple[int, tuple[int, ...]]:
    """(vocab_size, avoid_ids) for the prompts: the given values, or read from the model
    (its config for the vocabulary, its tokenizer's special tokens for 'auto')."""
    if vocab_size < 0:
        raise ValueError(f"--vocab-size={vocab_size} must be >= 0")
    from sarazmq.model.loader import load_model_config, load_tokenizer, resolve_model

    source = None
    if vocab_size == 0 or avoid == "auto":
        source = resolve_model(model)
    if vocab_size == 0:
        assert source is not None
        vocab_size = load_model_config(source).vocab_size
    if avoid != "auto":
        return vocab_size, parse_id_ranges(avoid)
    assert source is not None
    tok = load_tokenizer(source)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    special.update(tok.all_special_ids)
    return vocab_size, tuple(sorted(special))


def workload_spec(
    trace: str, kw: Mapping[str, Any], vocab: int, avoid: Sequence[int]
) -> WorkloadSpec:
    """The WorkloadSpec of TRACE and the workload options."""
    synthetic = trace in SYNTHETIC
    if not synthetic and not Path(trace).is_file():
        raise ValueError(
            f"TRACE {trace!r} is neither a file nor one of the synthetic workloads {SYNTHETIC}"
        )
    return WorkloadSpec(
        vocab_size=vocab,
        avoid_ids=tuple(avoid),
        trace_path=None if synthetic else trace,
        trace_kind=kw["trace_kind"],
        lengths=trace if synthetic else "trace",
        input_tokens=kw["input_tokens"],
        output_tokens=kw["output_tokens"],
        input_range=tuple(kw["input_range"]),
        output_range=tuple(kw["output_range"]),
        zipf_theta=kw["zipf_theta"],
        arrivals=kw["arrivals"],
        qps=kw.get("qps"),
        cv=kw["cv"],
        max_requests=kw["max_requests"],
        start=kw["start"],
        time_scale=kw.get("time_scale", 1.0),
        length_scale=kw["length_scale"],
        max_input_tokens=kw["max_input_tokens"],
        max_output_tokens=kw["max_output_tokens"],
        min_input_tokens=kw["min_input_tokens"],
        min_output_tokens=kw["min_output_tokens"],
        prefix_sharing=kw["prefix_sharing"],
        seed=kw["seed"],
    )


def _policies(text: str, option: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.BadParameter(
            f"{bad or text!r}: choose from {', '.join(POLICIES)}", param_hint=option
        )
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r} names a policy twice", param_hint=option)
    return names


def _engine_line(kw: Mapping[str, Any], policy: str) -> str:
    return (
        f"engine: {kw['model']}  scheduler: {policy}  chunk: {kw['chunk_size']}  "
        f"max_num_seqs: {kw['max_num_seqs']}  dtype: {kw['dtype']}  tp: {kw['tp']}  "
        f"kv blocks: {kw['num_kv_blocks'] or 'auto'}  max_model_len: {kw['max_model_len'] or 'auto'}"
    )


def _check_fit(requests: Sequence[WorkloadRequest], engine: Mapping[str, Any]) -> None:
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


def _run(
    endpoint: str,
    requests: Sequence[WorkloadRequest],
    kw: Mapping[str, Any],
    description: str,
    *,
    warmup: bool = True,
) -> ReplayOutcome:
    import asyncio

    out = asyncio.run(
        replay_detailed(
            endpoint,
            requests,
            progress=kw["progress"],
            concurrency_limit=kw["concurrency"],
            temperature=kw["temperature"],
            seed=kw["seed"],
            timeout=kw["request_timeout"],
            description=description,
            warmup=warmup,
        )
    )
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


def _run_settings(out: ReplayOutcome, engine: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **out.settings,
        "engine": dict(engine),
        "wall_s": out.wall_s,
        "max_send_lag_s": out.max_send_lag_s,
    }


def _prepare(
    trace: str, kw: dict[str, Any]
) -> tuple[WorkloadSpec, list[WorkloadRequest], dict[str, Any]]:
    try:
        vocab, avoid = prompt_vocabulary(kw["model"], kw["vocab_size"], kw["avoid_ids"])
        spec = workload_spec(trace, kw, vocab, avoid)
        requests = build_workload(spec)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if not requests:
        raise click.ClickException("the workload is empty (check --start / --max-requests)")
    return spec, requests, describe(spec, requests)


# ---------------------------------------------------------------------------- replay


@click.command(help=_REPLAY_HELP)
@click.argument("trace")
@_workload_options(retime=True)
@click.option(
    "--slo-ttft", type=float, default=None, help="goodput: a request's TTFT SLO (seconds)"
)
@click.option(
    "--slo-tbt", type=float, default=None, help="goodput: a request's P99 TBT SLO (seconds)"
)
@click.option(
    "--compare",
    default=None,
    help="comma-separated policies (e.g. sarathi,vllm,orca): replay the same workload "
    "against a fresh deployment of each, instead of --scheduler",
)
@click.option(
    "--baseline",
    default=None,
    help="policy the comparison's ratios are taken against (default: vllm when compared)",
)
@engine_options
def replay(trace: str, **kw: Any) -> None:
    """Replay TRACE against a deployment and report Sarathi-Serve's metrics (help text:
    _REPLAY_HELP)."""
    if kw["slo_ttft"] is not None and not kw["slo_ttft"] > 0:
        raise click.BadParameter("must be > 0", param_hint="--slo-ttft")
    if kw["slo_tbt"] is not None and not kw["slo_tbt"] > 0:
        raise click.BadParameter("must be > 0", param_hint="--slo-tbt")
    policies = _policies(kw["compare"], "--compare") if kw["compare"] else [kw["policy"]]
    comparing = kw["compare"] is not None
    if comparing and kw["connect"]:
        raise click.BadParameter(
            "--compare starts a fresh deployment per policy; it cannot use --connect",
            param_hint="--compare",
        )
    baseline = kw["baseline"]
    if baseline is None and comparing and "vllm" in policies:
        baseline = "vllm"
    if baseline is not None and baseline not in policies:
        raise click.BadParameter(f"{baseline!r} is not among {policies}", param_hint="--baseline")

    spec, requests, info = _prepare(trace, kw)
    click.echo(format_header(info))
    out_dir = Path(kw["output_dir"])
    summaries: dict[str, dict[str, Any]] = {}
    records = {}
    for policy in policies:
        run_kw = {**kw, "policy": policy}
        click.echo(
            _engine_line(run_kw, policy) if not kw["connect"] else f"target: {kw['connect']}"
        )
        config = None if kw["connect"] else build_config(run_kw)
        t0 = time.monotonic()
        try:
            with target(kw["connect"], config, kw["detokenizers"]) as (endpoint, engine):
                if not kw["connect"]:
                    click.echo(f"deployment ready in {time.monotonic() - t0:.1f} s", err=True)
                _check_fit(requests, engine)
                out = _run(endpoint, requests, kw, policy if comparing else "replay")
        except Exception as e:  # noqa: BLE001 - a failed deployment ends the command cleanly
            raise click.ClickException(f"{policy}: {type(e).__name__}: {e}") from None
        summary = summarize(out.records, out.iterations, kw["slo_ttft"], kw["slo_tbt"])
        run_dir = out_dir / policy if comparing else out_dir
        write_run(
            run_dir,
            summary,
            out.records,
            out.iterations,
            workload=info,
            settings=_run_settings(out, engine),
        )
        if comparing:
            click.echo(f"--- {policy}")
        click.echo(format_table(summary))
        click.echo(f"wrote {run_dir}/")
        summaries[policy] = summary
        records[policy] = out.records
    if comparing:
        write_comparison(out_dir, summaries, records, baseline=baseline)
        click.echo(format_comparison(summaries, baseline))
        click.echo(f"wrote {out_dir}/comparison.json, comparison.txt, compare_*_cdf.png")


# ---------------------------------------------------------------------------- capacity


def capacity_ratios(
    results: Mapping[str, CapacityResult], baseline: str | None
) -> dict[str, float | None]:
    """Each policy's capacity / the baseline's (None where either is undefined)."""
    if baseline is None or baseline not in results:
        return {}
    base = results[baseline].capacity_qps
    return {
        name: (r.capacity_qps / base if r.capacity_qps is not None and base else None)
        for name, r in results.items()
    }


def format_capacity(results: Mapping[str, CapacityResult], baseline: str | None) -> str:
    """A console table: capacity, bracket, stop reason and probes per policy."""
    ratios = capacity_ratios(results, baseline)
    lines = []
    for name, r in results.items():
        cap = "< lo" if r.capacity_qps is None else f"{r.capacity_qps:.4g} req/s"
        bad = "-" if r.lowest_failing_qps is None else f"{r.lowest_failing_qps:.4g}"
        ratio = ratios.get(name)
        rtext = "" if ratio is None else f"  {ratio:.2f}x {baseline}"
        lines.append(
            f"{name}: capacity {cap} (lowest failing {bad}, {r.stop_reason}, "
            f"{len(r.probes)} probes){rtext}"
        )
    return "\n".join(lines)


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
        out = _run(endpoint, requests, kw, f"{policy} @ {qps:.3g}/s", warmup=not probed)
        probed.append(qps)
        summary = summarize(out.records, out.iterations)
        write_run(
            out_dir / policy / f"qps-{qps:.4g}",
            summary,
            out.records,
            out.iterations,
            workload=describe(probe_spec, requests),
            settings=_run_settings(out, engine),
        )
        return summary

    return run_at_qps


@click.command(help=_CAPACITY_HELP)
@click.argument("trace")
@_workload_options(retime=False)
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
@engine_options
def capacity(trace: str, **kw: Any) -> None:
    """Search each policy's capacity on TRACE (help text: _CAPACITY_HELP)."""
    policies = _policies(kw["policies"], "--policies")
    if kw["connect"] and len(policies) > 1:
        raise click.BadParameter(
            "with --connect there is one deployment: give one policy (its own)",
            param_hint="--policies",
        )
    baseline = kw["baseline"] or ("vllm" if "vllm" in policies else None)
    if baseline is not None and baseline not in policies:
        raise click.BadParameter(f"{baseline!r} is not among {policies}", param_hint="--baseline")
    kw = {**kw, "qps": kw["lo_qps"]}  # a valid rate for the header; each probe sets its own
    spec, _, info = _prepare(trace, kw)
    click.echo(format_header(info))
    click.echo("(arrival times above are at --lo-qps; each probe re-times them at its rate)")
    out_dir = Path(kw["output_dir"])
    results: dict[str, CapacityResult] = {}
    for policy in policies:
        run_kw = {**kw, "policy": policy}
        click.echo(
            _engine_line(run_kw, policy) if not kw["connect"] else f"target: {kw['connect']}"
        )
        config = None if kw["connect"] else build_config(run_kw)
        try:
            with target(kw["connect"], config, kw["detokenizers"]) as (endpoint, engine):
                run_at_qps = _probe_runner(spec, endpoint, engine, kw, policy, out_dir)
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
