"""Co-location (Sarathi-Serve) against disaggregation (DistServe) in simulation: goodput
per GPU over a grid of SLOs, P:D splits, traces and KV link bandwidths
(docs/DISAGGREGATION.md).

Every instance is Mistral-7B on A100-80GB GPUs, one GPU each (Vidur's measured A100
Llama-3-8B table, the same layer shapes), its KV pool the GPU's memory less the weights.
Four GPUs per deployment:
  - sarathi x4: four co-located replicas, stall-free hybrid batches, budget 512
  - vllm x4: four co-located replicas, prefill-first (decodes stall behind prompts)
  - P:D = 1:3, 2:2, 3:1: P prefill instances (sarathi chunks of 512; `--prefill vllm`:
    whole prompts), D decode instances, each decode instance's KV link at --link-gbs
The router is least-load everywhere (these traces share no prefixes).

DistServe's goodput: the highest request rate at which at least 90 % of the requests meet
both their TTFT and TPOT SLOs; here per GPU. Each deployment is run at a ladder of rates
(Poisson arrivals, the same requests at every rate) and the goodput of each SLO pair is
read off the same runs (interpolated between the last passing and the first failing rung).

Usage: python scripts/disagg_grid.py [--traces sharegpt,arxiv,azure_code,azure_conv]
       [--requests 400] [--links 5,25,100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sarazmq.cli.sim_options import GPU_ELEM_BYTES, gpu_kv_blocks
from sarazmq.options import EngineOptions
from sarazmq.perf.cost import ModelCost
from sarazmq.perf.load import load_latency_model
from sarazmq.replay.metrics import RequestRecord, slo_goodput
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.sim.disagg import DisaggSpec, simulate_disaggregated
from sarazmq.sim.fleet import simulate_fleet
from sarazmq.sim.run import sim_engine_config

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
TRACE_FILES = {
    "sharegpt": TRACES / "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": TRACES / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "azure_code": TRACES / "azure_llm_2023_code.csv",
    "azure_conv": TRACES / "azure_llm_2023_conv.csv",
}
GPU, ARCH, GPUS = "a100", "mistral-7b", 4
MAX_IN, MAX_OUT = 8192, 2048
#: (name, TTFT SLO s, TPOT SLO s): a tight decode target, a tight prefill target, both
#: relaxed (at the scale of Mistral-7B on an A100: a 512-token chunk with decodes takes
#: ~60 ms, a decode-only iteration of 64 sequences ~25 ms)
SLOS = (("tight TPOT", 3.0, 0.025), ("tight TTFT", 0.5, 0.15), ("both relaxed", 3.0, 0.15))
ATTAINMENT = 0.9
DEPLOYMENTS = ("sarathi x4", "vllm x4", "1:3", "2:2", "3:1")


def workload(trace: str, n: int, rate: float) -> list[WorkloadRequest]:
    return build_workload(
        WorkloadSpec(
            vocab_size=32000,
            trace_path=str(TRACE_FILES[trace]),
            max_requests=n,
            qps=rate,  # Poisson re-timing at `rate` (the same rows and lengths every rate)
            max_input_tokens=MAX_IN,
            max_output_tokens=MAX_OUT,
            seed=0,
        )
    )


def run(
    name: str, reqs: list[WorkloadRequest], link_gbs: float, prefill: str, latency: Any
) -> list[RequestRecord]:  # noqa: E501
    blocks = gpu_kv_blocks(GPU, ARCH, 1, 16)
    resolved = {"num_blocks": blocks, "max_model_len": MAX_IN + MAX_OUT}
    if name.endswith("x4"):
        policy = name.split()[0]
        opts = EngineOptions(
            scheduler=policy, chunk_size=512 if policy == "sarathi" else MAX_IN + MAX_OUT,
            data_parallel_size=GPUS, router="least-load",
        )  # fmt: skip
        return simulate_fleet(reqs, sim_engine_config(opts, **resolved), latency).records
    p, d = (int(x) for x in name.split(":"))
    chunk = 512 if prefill == "sarathi" else MAX_IN + MAX_OUT
    pcfg = sim_engine_config(
        EngineOptions(scheduler=prefill, chunk_size=chunk, router="least-load"), **resolved
    )
    dcfg = sim_engine_config(EngineOptions(router="least-load"), **resolved)
    kv = int(ModelCost.from_architecture(ARCH, GPU_ELEM_BYTES, 1).kv_bytes_per_token)
    spec = DisaggSpec(p, d, link_gbs * 1e9, kv)
    return simulate_disaggregated(reqs, pcfg, dcfg, latency, latency, spec).records


def goodput(points: list[tuple[float, float]]) -> float:
    """The highest rate with attainment >= ATTAINMENT, interpolated to the first rung
    that fails (0 when even the lowest rung fails)."""
    best = 0.0
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a0 >= ATTAINMENT > a1:
            return r0 + (r1 - r0) * (a0 - ATTAINMENT) / (a0 - a1)
        if a1 >= ATTAINMENT:
            best = r1
    if points and points[0][1] >= ATTAINMENT:
        best = max(best, points[0][0])
    return best


def ladder(trace: str, name: str, n: int, rates: list[float], link: float, prefill: str,
           latency: Any) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    """Per SLO pair: (rate, attainment) at each rung, stopping once every pair fails."""
    out: dict[str, list[tuple[float, float]]] = {s[0]: [] for s in SLOS}
    for rate in rates:
        recs = run(name, workload(trace, n, rate), link, prefill, latency)
        failing = 0
        for slo, ttft, tpot in SLOS:
            a = slo_goodput(recs, ttft, tpot, GPUS)["attainment"]
            out[slo].append((rate, a))
            failing += a < ATTAINMENT
        if failing == len(SLOS):
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="sharegpt,arxiv,azure_code,azure_conv")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rates", default="1,2,3,4,6,8,10,12,16,20,24,32,40")
    ap.add_argument("--link-gbs", type=float, default=25.0, help="the KV link of the main grid")
    ap.add_argument("--links", default="1,5,25,100", help="links for the bandwidth study (arxiv)")
    ap.add_argument("--prefill", default="sarathi", choices=("sarathi", "vllm"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    latency, _ = load_latency_model(None, GPU, ARCH)
    rates = [float(x) for x in args.rates.split(",")]
    rows: list[dict[str, Any]] = []
    print(
        f"goodput per GPU (req/s per GPU, {int(ATTAINMENT * 100)} % of requests within both SLOs)"
    )
    print(
        f"{'trace':<11} {'SLO (TTFT s, TPOT s)':<28} " + " ".join(f"{d:>10}" for d in DEPLOYMENTS)
    )
    for trace in args.traces.split(","):
        per_dep = {
            d: ladder(trace, d, args.requests, rates, args.link_gbs, args.prefill, latency)
            for d in DEPLOYMENTS
        }
        for slo, ttft, tpot in SLOS:
            g = {d: goodput(per_dep[d][slo]) / GPUS for d in DEPLOYMENTS}
            rows.append({"trace": trace, "slo": slo, "ttft": ttft, "tpot": tpot, **g})
            label = f"{slo} ({ttft:g}, {tpot:g})"
            print(f"{trace:<11} {label:<28} " + " ".join(f"{g[d]:>10.3f}" for d in DEPLOYMENTS),
                  flush=True)  # fmt: skip
    print(f"\nKV link bandwidth (arxiv, goodput per GPU, SLO '{SLOS[2][0]}'):")
    for link in (float(x) for x in args.links.split(",")):
        g = {}
        for d in DEPLOYMENTS[2:]:
            pts = ladder("arxiv", d, args.requests, rates, link, args.prefill, latency)
            g[d] = goodput(pts[SLOS[2][0]]) / GPUS
        rows.append({"study": "link", "link_gbs": link, **g})
        print(f"  {link:>6g} GB/s  " + " ".join(f"{d} {g[d]:.3f}" for d in DEPLOYMENTS[2:]),
              flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
