"""What `sarazmq replay` and `sarazmq capacity` share: the workload options and running one.

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

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import stack
from sarazmq.config import POLICIES
from sarazmq.replay.describe import describe
from sarazmq.replay.traces import TRACE_KINDS
from sarazmq.replay.vocabulary import prompt_vocabulary
from sarazmq.replay.workload import (
    ARRIVAL_KINDS,
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
)

SYNTHETIC = ("fixed", "uniform", "zipf")

TRACE_HELP = """TRACE is a trace file (Azure LLM trace CSV, Mooncake JSONL, Sarathi's
ShareGPT lengths CSV; the kind is read from the header) or a synthetic workload:
'fixed' (--input-tokens, --output-tokens), 'uniform' or 'zipf' (--input-range,
--output-range, --zipf-theta). Synthetic workloads need --max-requests and an arrival
process (--qps, or --arrivals all_at_once). For a file named like a keyword write ./fixed.

Fitting flags apply in this order: rows (--start, --max-requests), lengths
(--length-scale, then clipping to --min/--max-input/output-tokens), arrivals (trace
times or --qps re-timing, then --time-scale). The header printed first shows the result.
Prompts are random token ids (never --avoid-ids) of exactly the input length, sent with
ignore_eos and max_tokens = the output length."""


# ---------------------------------------------------------------------------- options


def workload_options(*, retime: bool) -> Callable[[Any], Any]:
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


def comparison_options(runs: str) -> Callable[[Any], Any]:
    """--slo-ttft/--slo-tbt (goodput) and --compare/--baseline of a command that runs one
    workload per policy; `runs` says how in --compare's help ("replay ... against a fresh
    deployment of each")."""
    return stack(
        click.option(
            "--slo-ttft", type=float, default=None, help="goodput: a request's TTFT SLO (seconds)"
        ),
        click.option(
            "--slo-tbt", type=float, default=None, help="goodput: a request's P99 TBT SLO (seconds)"
        ),
        click.option(
            "--compare",
            default=None,
            help=f"comma-separated policies (e.g. sarathi,vllm,orca): {runs}, instead of "
            "--scheduler",
        ),
        click.option(
            "--baseline",
            default=None,
            help="policy the comparison's ratios are taken against (default: vllm when compared)",
        ),
    )


def comparison_policies(kw: Mapping[str, Any]) -> tuple[list[str], bool, str | None]:
    """(policies to run, comparing?, baseline) of `comparison_options`; one-line click
    errors for a bad SLO, policy list or baseline."""
    for opt in ("slo_ttft", "slo_tbt"):
        if kw[opt] is not None and not kw[opt] > 0:
            raise click.BadParameter("must be > 0", param_hint=f"--{opt.replace('_', '-')}")
    comparing = kw["compare"] is not None
    policies = parse_policies(kw["compare"], "--compare") if comparing else [kw["scheduler"]]
    baseline = kw["baseline"]
    if baseline is None and comparing and "vllm" in policies:
        baseline = "vllm"
    if baseline is not None and baseline not in policies:
        raise click.BadParameter(f"{baseline!r} is not among {policies}", param_hint="--baseline")
    return policies, comparing, baseline


def parse_policies(text: str, option: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.BadParameter(
            f"{bad or text!r}: choose from {', '.join(POLICIES)}", param_hint=option
        )
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r} names a policy twice", param_hint=option)
    return names


def prepare_workload(
    trace: str, kw: dict[str, Any]
) -> tuple[WorkloadSpec, list[WorkloadRequest], dict[str, Any]]:
    try:
        vocab, avoid = prompt_vocabulary(
            kw["model"], kw["vocab_size"], kw["avoid_ids"], kw.get("load_format", "auto")
        )
        spec = workload_spec(trace, kw, vocab, avoid)
        requests = build_workload(spec)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if not requests:
        raise click.ClickException("the workload is empty (check --start / --max-requests)")
    return spec, requests, describe(spec, requests, block_size=kw["block_size"])
