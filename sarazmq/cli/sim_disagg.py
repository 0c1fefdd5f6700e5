"""`sarazmq simulate --disaggregate P:D`: prefill and decode on separate instances
(`sarazmq.sim.disagg`), and DistServe's goodput per GPU for every simulation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import stack
from sarazmq.cli.sim_options import GPU_ELEM_BYTES, load_latency, sim_config
from sarazmq.config import POLICIES, EngineConfig
from sarazmq.replay.metrics import RequestRecord, slo_goodput
from sarazmq.replay.report import write_run
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sim.disagg import DisaggSpec, simulate_disaggregated
from sarazmq.sim.run import sim_run_settings

#: the KV link per decode instance by default: a 200 Gb/s InfiniBand port
DEFAULT_KV_LINK_GBS = 25.0

disagg_options = stack(
    click.option(
        "--disaggregate",
        default=None,
        metavar="P:D",
        help="prefill on P instances, decode on D others; the prompt's KV crosses a link "
        "after its first token (needs --gpu/--arch)",
    ),
    click.option(
        "--kv-link-gbs",
        type=float,
        default=DEFAULT_KV_LINK_GBS,
        show_default=True,
        help="with --disaggregate: GB/s of each decode instance's inbound KV link",
    ),
    click.option(
        "--prefill-scheduler",
        type=click.Choice(POLICIES),
        default="sarathi",
        show_default=True,
        help="with --disaggregate: the prefill instances' policy (sarathi: chunked; vllm: "
        "whole prompts); the decode instances run --scheduler",
    ),
    click.option(
        "--decode-tp",
        type=int,
        default=None,
        help="with --disaggregate: GPUs per decode instance (default: --tp)",
    ),
    click.option(
        "--slo-tpot",
        type=float,
        default=None,
        help="with --slo-ttft: DistServe's goodput (TTFT and time per output token within "
        "their SLOs) per second and per GPU",
    ),
)


def parse_split(text: str) -> tuple[int, int]:
    """(P, D) of "P:D"; click error naming --disaggregate otherwise."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter("must be P:D, e.g. 1:3", param_hint="--disaggregate") from None
    if p < 1 or d < 1:
        raise click.BadParameter("P and D must be >= 1", param_hint="--disaggregate")
    return p, d


def num_gpus(config: EngineConfig) -> int:
    """GPUs of a co-located deployment: replicas x tp x pp."""
    return config.data_parallel_size * config.tensor_parallel_size * config.pipeline_parallel_size


def add_goodput(
    summary: dict[str, Any], records: Sequence[RequestRecord], kw: Mapping[str, Any], gpus: int
) -> None:
    """summary["slo_goodput"] when --slo-ttft and --slo-tpot are both given."""
    if kw.get("slo_ttft") is not None and kw.get("slo_tpot") is not None:
        summary["slo_goodput"] = slo_goodput(records, kw["slo_ttft"], kw["slo_tpot"], gpus)


def goodput_line(g: Mapping[str, Any]) -> str:
    return (
        f"goodput (TTFT <= {g['slo_ttft_s']} s, TPOT <= {g['slo_tpot_s']} s): "
        f"{g['attainment']:.3f} of requests, {g['requests_per_s']:.3f} req/s, "
        f"{g['per_gpu']:.3f} req/s per GPU ({g['num_gpus']} GPUs)"
    )


def run_disaggregated(
    requests: Sequence[WorkloadRequest],
    kw: dict[str, Any],
    info: dict[str, Any],
    latency: Any,
    run_dir: Path,
    workload: dict[str, Any],
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Simulates `--disaggregate P:D` and writes the run; (summary, records)."""
    from sarazmq.perf.cost import ModelCost

    p, d = parse_split(kw["disaggregate"])
    if not kw.get("gpu") or not kw.get("arch"):
        raise click.BadParameter("needs --gpu and --arch", param_hint="--disaggregate")
    if kw["data_parallel_size"] != 1 or kw["pipeline_parallel_size"] != 1:
        raise click.BadParameter(
            "the instances are P:D, each --tp GPUs (pp 1): drop --dp/--pp",
            param_hint="--disaggregate",
        )
    if not kw["kv_link_gbs"] > 0:
        raise click.BadParameter("must be > 0", param_hint="--kv-link-gbs")
    tp_d = kw["decode_tp"] or kw["tensor_parallel_size"]
    prefill_cfg = sim_config({**kw, "scheduler": kw["prefill_scheduler"]}, info, requests)
    if tp_d == kw["tensor_parallel_size"]:
        decode_cfg, decode_latency = sim_config(kw, info, requests), latency
    else:
        decode_kw = {**kw, "tensor_parallel_size": tp_d}
        decode_latency, decode_info = load_latency(decode_kw)
        decode_cfg = sim_config(decode_kw, decode_info, requests)
    kv_bytes = int(ModelCost.from_architecture(kw["arch"], GPU_ELEM_BYTES, 1).kv_bytes_per_token)
    spec = DisaggSpec(p, d, kw["kv_link_gbs"] * 1e9, kv_bytes)
    click.echo(
        f"disaggregated: {p} prefill ({kw['prefill_scheduler']}, tp {prefill_cfg.tensor_parallel_size})"
        f" : {d} decode ({decode_cfg.scheduler.policy}, tp {tp_d}) instances, KV link "
        f"{kw['kv_link_gbs']:g} GB/s per decode instance, {kv_bytes / 1024:.0f} KiB per token"
    )
    try:
        out = simulate_disaggregated(
            requests, prefill_cfg, decode_cfg, latency, decode_latency, spec,
            overhead_s=info["overhead_s"],
        )  # fmt: skip
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    summary = out.summary(kw["slo_ttft"], kw["slo_tbt"])
    summary["disaggregated"] = {
        "prefill": p,
        "decode": d,
        "prefill_tp": prefill_cfg.tensor_parallel_size,
        "decode_tp": tp_d,
        "kv_link_gbs": kw["kv_link_gbs"],
        "kv_transfers": out.transfers,
    }
    add_goodput(summary, out.records, kw, p * prefill_cfg.tensor_parallel_size + d * tp_d)
    settings = sim_run_settings(prefill_cfg, info, out) | {
        "decode_engine": dataclasses.asdict(decode_cfg)
    }
    write_run(run_dir, summary, out.records, [], workload=workload, settings=settings,
              plots=kw["plots"])  # fmt: skip
    return summary, out.records
