"""Pipeline bubbles at GPU scale, simulated: sarathi vs vllm on TP4 x PP2 A100 deployments.

Sarathi-Serve (OSDI'24) argues that its hybrid batches of near-uniform token count keep
the pipeline's micro-batches alike, so stages rarely wait for each other, while
prefill-first batching (vLLM) alternates long prefill and short decode micro-batches and
leaves bubbles. This script measures that in `sarazmq.sim`: the real scheduler with up to
pp plans in flight, per-stage times from the A100 latency model split over the stages
(`sarazmq.perf.pipeline`), activations sent between stages at --pp-link-gbs.

For each model (Llama-2-70B at TP4 x PP1 and TP4 x PP2; Falcon-180B at TP4 x PP2, the
paper's deployment: it does not fit TP4 x PP1), each Poisson rate, each policy, the same
trace window (the first --requests rows of the trace, re-timed at that rate): bubble
fraction (idle stage time / total stage time while a micro-batch is in flight), output
tok/s, TTFT and TBT P50/P99. Then the ratios, each against a baseline of the same run:
bubble fraction vllm / sarathi, output tok/s sarathi / vllm at PP1 and PP2, and PP2 / PP1.

With --capacity-slo S[,S...]: also the serving capacity of each deployment and policy
(`sarazmq capacity --simulate`: the highest Poisson rate with P99 TBT <= S and median
scheduling delay <= 2 s), the paper's end-to-end measure, and its sarathi / vllm ratio.

Usage: python scripts/pp_bubbles.py [--requests 400] [--qps 1,2,4] [--json out.json]
           [--capacity-slo 0.5,1.0 --capacity-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarazmq.cli.sim_options import gpu_kv_blocks
from sarazmq.perf.load import load_latency_model
from sarazmq.perf.pipeline import DEFAULT_PP_LINK_BANDWIDTH
from sarazmq.replay.metrics import summarize
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.sim import simulate_workload

TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "traces"
    / "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
)
GPU = "a100"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Deployment:
    """A model on tp x pp A100s."""

    model: str
    arch: str
    tp: int
    pp: int

    @property
    def label(self) -> str:
        return f"{self.model} TP{self.tp}xPP{self.pp}"


DEPLOYMENTS = (
    Deployment("Llama-2-70B", "llama-2-70b", 4, 1),
    Deployment("Llama-2-70B", "llama-2-70b", 4, 2),
    Deployment("Falcon-180B", "falcon-180b", 4, 2),
)


@dataclass(frozen=True)
class Policy:
    """A scheduling policy and its token budget (chunk size; vllm has none)."""

    name: str
    policy: str
    chunk_size: int


def _policies(chunks: Sequence[int]) -> list[Policy]:
    out = [Policy(f"sarathi-{c}", "sarathi", c) for c in chunks]
    return [*out, Policy("vllm", "vllm", max(chunks))]


def run_cell(
    dep: Deployment,
    pol: Policy,
    requests: Sequence[WorkloadRequest],
    max_num_seqs: int,
    link_bandwidth: float,
) -> dict[str, Any]:
    """One simulation; its metrics as a flat dict."""
    latency, _ = load_latency_model(
        None, GPU, dep.arch, dep.tp, pp=dep.pp, pp_link_bandwidth=link_bandwidth
    )
    num_blocks = gpu_kv_blocks(GPU, dep.arch, dep.tp, BLOCK_SIZE, dep.pp)
    longest = max(r.input_tokens + r.output_tokens for r in requests)
    t0 = time.perf_counter()
    out = simulate_workload(
        requests,
        {
            "scheduler": pol.policy,
            "chunk_size": pol.chunk_size,
            "max_num_seqs": max_num_seqs,
            "enable_prefix_caching": False,
        },
        latency,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_model_len=longest,
        seed=0,
    )
    s = summarize(out.records, out.iterations)
    if out.pipeline is None:
        raise RuntimeError("the simulation recorded no pipeline stats")
    return {
        "deployment": dep.label,
        "model": dep.model,
        "tp": dep.tp,
        "pp": dep.pp,
        "policy": pol.name,
        "completed": sum(1 for r in out.records if r.ok),
        "bubble_fraction": out.pipeline.bubble_fraction,
        "output_tok_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tbt_p50_s": s["tbt_s"]["p50"],
        "tbt_p99_s": s["tbt_s"]["p99"],
        "makespan_s": s["makespan_s"],
        "num_kv_blocks": num_blocks,
        "sim_wall_s": time.perf_counter() - t0,
    }


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(cells: Sequence[dict[str, Any]], policies: Sequence[Policy]) -> str:
    """The measured table and the ratio tables (all from `cells`)."""
    rows = [
        [
            c["deployment"],
            f"{c['qps']:g}",
            c["policy"],
            f"{c['bubble_fraction']:.3f}",
            f"{c['output_tok_s']:.0f}",
            f"{c['ttft_p50_s']:.2f}",
            f"{c['ttft_p99_s']:.2f}",
            f"{c['tbt_p50_s'] * 1e3:.0f}",
            f"{c['tbt_p99_s'] * 1e3:.0f}",
        ]
        for c in cells
    ]
    head = ["deployment", "qps", "policy", "bubble", "out tok/s", "TTFT p50 s", "TTFT p99 s"]
    parts = [_table([*head, "TBT p50 ms", "TBT p99 ms"], rows)]
    by = {(c["deployment"], c["qps"], c["policy"]): c for c in cells}
    sarathis = [p.name for p in policies if p.policy == "sarathi"]
    ratio_rows = []
    for dep, qps, pol in by:
        if pol != "vllm":
            continue
        v = by[(dep, qps, pol)]
        for s in sarathis:
            c = by.get((dep, qps, s))
            if c is None:
                continue
            ratio_rows.append(
                [
                    dep,
                    f"{qps:g}",
                    s,
                    _ratio(v["bubble_fraction"], c["bubble_fraction"]),
                    _ratio(c["output_tok_s"], v["output_tok_s"]),
                    _ratio(v["tbt_p99_s"], c["tbt_p99_s"]),
                ]
            )
    parts.append(
        "sarathi against vllm, same deployment and window:\n"
        + _table(
            [
                "deployment",
                "qps",
                "sarathi",
                "bubble vllm/sarathi",
                "tok/s sarathi/vllm",
                "TBT p99 vllm/sarathi",
            ],  # fmt: skip
            ratio_rows,
        )
    )
    pp_rows = []
    for (_dep, qps, pol), c2 in by.items():
        if c2["pp"] != 2:
            continue
        one = next(
            (
                c
                for (d, q, p), c in by.items()
                if q == qps and p == pol and c["pp"] == 1 and c["model"] == c2["model"]
            ),
            None,
        )
        if one is None:
            continue
        pp_rows.append(
            [
                c2["model"],
                f"{qps:g}",
                pol,
                _ratio(c2["output_tok_s"], one["output_tok_s"]),
                _ratio(one["ttft_p50_s"], c2["ttft_p50_s"]),
                _ratio(one["tbt_p99_s"], c2["tbt_p99_s"]),
            ]
        )
    if pp_rows:
        parts.append(
            "PP2 (8 GPUs) against PP1 (4 GPUs), same model, policy and window:\n"
            + _table(
                [
                    "model",
                    "qps",
                    "policy",
                    "tok/s PP2/PP1",
                    "TTFT p50 PP1/PP2",
                    "TBT p99 PP1/PP2",
                ],  # fmt: skip
                pp_rows,
            )
        )
    return "\n\n".join(parts)


def capacity(
    dep: Deployment,
    pol: Policy,
    slo: float,
    trace: str,
    requests: int,
    max_num_seqs: int,
    link_gbs: float,
    out: Path,
) -> float:
    """The capacity (req/s) `sarazmq capacity --simulate` finds for one deployment,
    policy and P99 TBT SLO (resumable: an existing capacity.json is read, not redone)."""
    cell = out / f"{dep.arch}_tp{dep.tp}_pp{dep.pp}_{pol.name}_slo{slo:g}"
    if not (cell / "capacity.json").is_file():
        cmd = [
            sys.executable, "-m", "sarazmq.cli", "capacity", trace, "--simulate",
            "--gpu", GPU, "--arch", dep.arch, "--tp", str(dep.tp), "--pp", str(dep.pp),
            "--pp-link-gbs", str(link_gbs), "--policies", pol.policy,
            "--chunk-size", str(pol.chunk_size), "--max-num-seqs", str(max_num_seqs),
            "--max-requests", str(requests), "--slo-tbt", str(slo),
            "--slo-sched-delay", "2", "--lo-qps", "0.1", "--hi-qps", "0.4",
            "--max-probes", "10", "--rel-tol", "0.05", "--no-prefix-caching",
            "--no-progress", "--output-dir", str(cell),
        ]  # fmt: skip
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads((cell / "capacity.json").read_text(encoding="utf-8"))
    return float(data["results"][pol.policy]["capacity_qps"] or 0.0)


def capacity_report(caps: dict[tuple[str, float, str], float], policies: Sequence[Policy]) -> str:
    """Capacity per deployment, SLO and policy, with sarathi / vllm and PP2 / PP1."""
    rows = []
    for dep in DEPLOYMENTS:
        for slo in sorted({k[1] for k in caps}):
            got = {p.name: caps.get((dep.label, slo, p.name)) for p in policies}
            if any(v is None for v in got.values()):
                continue
            vllm = got["vllm"]
            best = max(v for k, v in got.items() if k != "vllm" and v is not None)
            pp1 = f"{dep.model} TP{dep.tp}xPP1"
            scale = [
                _ratio(got[p.name], caps.get((pp1, slo, p.name))) if dep.pp == 2 else "-"
                for p in policies
            ]
            rows.append(
                [
                    dep.label,
                    f"{slo:g}",
                    *(f"{got[p.name]:.2f}" for p in policies),
                    _ratio(best, vllm),
                    *scale,
                ]
            )
    heads = ["deployment", "P99 TBT SLO s", *(f"{p.name} req/s" for p in policies)]
    return "serving capacity (P99 TBT <= SLO, median scheduling delay <= 2 s):\n" + _table(
        [*heads, "best sarathi/vllm", *(f"{p.name} PP2/PP1" for p in policies)], rows
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE), help="a length trace (ShareGPT by default)")
    ap.add_argument("--requests", type=int, default=400, help="the window: first N rows")
    ap.add_argument("--qps", default="1,2,4", help="comma-separated Poisson rates")
    ap.add_argument("--chunks", default="512,256", help="sarathi token budgets")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument(
        "--pp-link-gbs",
        type=float,
        default=DEFAULT_PP_LINK_BANDWIDTH / 1e9,
        help="GB/s between the stages (default: 200 Gb/s InfiniBand per GPU)",
    )
    ap.add_argument("--models", default="", help="only these models (e.g. Llama-2-70B)")
    ap.add_argument("--json", default="", help="also write the cells here")
    ap.add_argument("--capacity-slo", default="", help="P99 TBT SLOs (s) for capacity runs")
    ap.add_argument("--capacity-dir", default="pp_capacity_out", help="capacity runs go here")
    ap.add_argument("--capacity-requests", type=int, default=256)
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    rates = [float(q) for q in args.qps.split(",") if q.strip()]
    if not rates or any(q <= 0 for q in rates):
        ap.error("--qps needs positive rates")
    policies = _policies([int(c) for c in args.chunks.split(",") if c.strip()])
    wanted = {m.strip() for m in args.models.split(",") if m.strip()}
    deployments = [d for d in DEPLOYMENTS if not wanted or d.model in wanted]
    cells: list[dict[str, Any]] = []
    for qps in rates:
        spec = WorkloadSpec(
            vocab_size=32000, trace_path=args.trace, qps=qps, max_requests=args.requests
        )
        requests = build_workload(spec)
        for dep in deployments:
            for pol in policies:
                cell = run_cell(dep, pol, requests, args.max_num_seqs, args.pp_link_gbs * 1e9)
                cells.append({"qps": qps, **cell})
                print(
                    f"{dep.label} qps {qps:g} {pol.name}: bubble "
                    f"{cell['bubble_fraction']:.3f} ({cell['sim_wall_s']:.1f} s)",
                    flush=True,
                )
    print()
    print(
        f"{args.requests} requests of {Path(args.trace).name} per rate (Poisson), A100 "
        f"latency model, stages linked at {args.pp_link_gbs:g} GB/s, max_num_seqs "
        f"{args.max_num_seqs}, no prefix caching\n"
    )
    print(report(cells, policies))
    slos = [float(x) for x in args.capacity_slo.split(",") if x.strip()]
    caps: dict[tuple[str, float, str], float] = {}
    for slo in slos:
        for dep in deployments:
            for pol in policies:
                caps[(dep.label, slo, pol.name)] = capacity(
                    dep, pol, slo, args.trace, args.capacity_requests, args.max_num_seqs,
                    args.pp_link_gbs, Path(args.capacity_dir),
                )  # fmt: skip
    if caps:
        print()
        print(capacity_report(caps, policies))
    if args.json:
        data = {
            "cells": cells,
            "capacity": [
                {"deployment": d, "slo_tbt_s": slo, "policy": p, "capacity_qps": v}
                for (d, slo, p), v in caps.items()
            ],
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
