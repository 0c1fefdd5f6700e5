"""Co-location (Sarathi-Serve) against disaggregation (DistServe) in simulation: goodput
per GPU over a grid of SLOs, P:D splits, traces and KV link bandwidths
(docs/DISAGGREGATION.md).

Every instance is Mistral-7B on A100-80GB GPUs, one GPU each (Vidur's measured A100
Llama-3-8B table, the same layer shapes), its KV pool the GPU's memory less the weights.
Four GPUs per deployment:
  - sarathi x4: four co-located replicas, stall-free hybrid batches, budget 512
  - sarathi-2k x4: the same with a budget of 2048 (Sarathi-Serve's choice for relaxed
    SLOs: fewer, larger iterations, more prefill throughput, longer stalls)
  - vllm x4: four co-located replicas, prefill-first (decodes stall behind prompts)
  - P:D = 1:3, 2:2, 3:1: P prefill instances (sarathi chunks of 512; `--prefill vllm`:
    whole prompts), D decode instances, each decode instance's KV link at --link-gbs
The router is least-load everywhere (these traces share no prefixes).

DistServe's goodput: the highest request rate at which at least 90 % of the requests meet
both their TTFT and TPOT SLOs; here per GPU. Each deployment is run at a ladder of rates
(Poisson arrivals, the same requests at every rate) and the goodput of each SLO pair is
read off the same runs (interpolated between the last passing and the first failing rung):
the three named pairs as a table, then a winner map over a grid of TTFT x TPOT SLOs (the
deployment with the highest goodput per GPU in each cell), and the KV link study.

Usage: python scripts/disagg_grid.py [--traces sharegpt,arxiv,azure_code,azure_conv]
       [--requests 400] [--links 1,5,25,100] [--json out.json] [--plot-dir docs/disagg]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sarazmq.cli.sim_options import GPU_ELEM_BYTES, gpu_kv_blocks
from sarazmq.options import EngineOptions
from sarazmq.perf.cost import ModelCost
from sarazmq.perf.load import load_latency_model
from sarazmq.replay.metrics import RequestRecord, request_metrics
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
SLOS = (("tight TPOT", 4.0, 0.025), ("tight TTFT", 0.5, 0.15), ("both relaxed", 4.0, 0.15))
#: the SLO grid of the winner map (every named pair is on it)
GRID_TTFT = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GRID_TPOT = (0.015, 0.02, 0.025, 0.04, 0.06, 0.1, 0.15)
ATTAINMENT = 0.9
DEPLOYMENTS = ("sarathi x4", "sarathi-2k x4", "vllm x4", "1:3", "2:2", "3:1")
COLOCATED = 3  # the first three are co-located


@dataclass
class Rung:
    """One simulated run at one rate: each request's TTFT and TPOT (inf when it failed;
    TPOT 0 with one output token) and the run's makespan."""

    rate: float
    ttft: np.ndarray
    tpot: np.ndarray

    @classmethod
    def of(cls, rate: float, records: list[RequestRecord]) -> Rung:
        ttft, tpot = [], []
        for r in records:
            m = request_metrics(r) if r.ok else None
            ok = m is not None and m.ttft_s is not None
            ttft.append(m.ttft_s if ok else np.inf)  # type: ignore[union-attr]
            tpot.append((m.tpot_s or 0.0) if ok else np.inf)  # type: ignore[union-attr]
        return cls(rate, np.array(ttft), np.array(tpot))

    def attainment(self, slo_ttft: float, slo_tpot: float) -> float:
        """The share of requests within both SLOs (`slo_goodput`'s attainment)."""
        return float(np.mean((self.ttft <= slo_ttft) & (self.tpot <= slo_tpot)))


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
        chunk = {"sarathi": 512, "sarathi-2k": 2048}.get(policy, MAX_IN + MAX_OUT)
        opts = EngineOptions(
            scheduler=policy.split("-")[0], chunk_size=chunk, data_parallel_size=GPUS,
            router="least-load",
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


def goodput(rungs: list[Rung], slo_ttft: float, slo_tpot: float) -> float:
    """The highest rate with attainment >= ATTAINMENT, interpolated to the first rung
    that fails (0 when even the lowest rung fails)."""
    points = [(r.rate, r.attainment(slo_ttft, slo_tpot)) for r in rungs]
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
           latency: Any) -> list[Rung]:  # fmt: skip
    """The deployment's runs at each rate, up to the first where even the most relaxed
    SLO pair of the grid fails."""
    rungs: list[Rung] = []
    for rate in rates:
        rung = Rung.of(rate, run(name, workload(trace, n, rate), link, prefill, latency))
        rungs.append(rung)
        if rung.attainment(max(GRID_TTFT), max(GRID_TPOT)) < ATTAINMENT:
            break
    return rungs


def winner_map(trace: str, per_dep: dict[str, list[Rung]]) -> list[dict[str, Any]]:
    """Per grid SLO pair: every deployment's goodput per GPU and the winner."""
    cells = []
    for ttft in GRID_TTFT:
        for tpot in GRID_TPOT:
            g = {d: goodput(per_dep[d], ttft, tpot) / GPUS for d in DEPLOYMENTS}
            best = max(g, key=lambda d: g[d])
            # within 2 % of each other: no winner (the rate ladder cannot tell them apart)
            close = [d for d in DEPLOYMENTS if d != best and g[d] >= 0.98 * g[best]]
            winner = "-" if g[best] == 0 else "tie" if close else best
            cells.append({"trace": trace, "ttft": ttft, "tpot": tpot, "goodput": g,
                          "best": best, "winner": winner})  # fmt: skip
    return cells


def print_map(cells: list[dict[str, Any]]) -> None:
    """The winner of each SLO pair (rows: TPOT, columns: TTFT) and its goodput per GPU."""
    corner = "TPOT \\ TTFT"
    print(f"  {corner:>12} " + " ".join(f"{t:>17g}" for t in GRID_TTFT))
    for tpot in GRID_TPOT:
        row = [c for c in cells if c["tpot"] == tpot]
        text = " ".join(f"{c['winner']:>10} {c['goodput'][c['best']]:>6.2f}" for c in row)
        print(f"  {tpot:>12g} {text}")


def plot_map(cells: list[dict[str, Any]], path: Path) -> None:
    """The winner map as an image: one colour per deployment, its goodput per GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip((*DEPLOYMENTS, "tie", "-"), plt.get_cmap("Pastel1").colors))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in cells:
        x, y = GRID_TTFT.index(c["ttft"]), GRID_TPOT.index(c["tpot"])
        ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=colours[c["winner"]]))
        g = c["goodput"][c["best"]]
        ax.text(x, y, f"{c['winner']}\n{g:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.5, len(GRID_TTFT) - 0.5)
    ax.set_ylim(-0.5, len(GRID_TPOT) - 0.5)
    ax.set_xticks(range(len(GRID_TTFT)), [f"{t:g}" for t in GRID_TTFT])
    ax.set_yticks(range(len(GRID_TPOT)), [f"{t * 1000:g}" for t in GRID_TPOT])
    ax.set_xlabel("TTFT SLO (s)")
    ax.set_ylabel("TPOT SLO (ms)")
    ax.set_title(f"{cells[0]['trace']}: best goodput per GPU (req/s, 90 % attainment)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="sharegpt,arxiv,azure_code,azure_conv")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rates", default="1,2,3,4,6,8,10,12,16,20,24,32,40,48,64,80")
    ap.add_argument("--link-gbs", type=float, default=25.0, help="the KV link of the main grid")
    ap.add_argument("--links", default="1,5,25,100", help="links for the bandwidth study (arxiv)")
    ap.add_argument("--prefill", default="sarathi", choices=("sarathi", "vllm"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot-dir", default=None, help="write each trace's winner map here")
    args = ap.parse_args()
    latency, _ = load_latency_model(None, GPU, ARCH)
    rates = [float(x) for x in args.rates.split(",")]
    ladders: dict[tuple[str, str, float], list[Rung]] = {}

    def rungs(trace: str, dep: str, link: float) -> list[Rung]:
        if dep.endswith("x4"):
            link = 0.0  # co-located: no link
        key = (trace, dep, link)
        if key not in ladders:
            ladders[key] = ladder(trace, dep, args.requests, rates, link, args.prefill, latency)
        return ladders[key]

    rows: list[dict[str, Any]] = []
    print(
        f"goodput per GPU (req/s per GPU, {int(ATTAINMENT * 100)} % of requests within both "
        f"SLOs; P:D with {args.prefill} prefill, KV link {args.link_gbs:g} GB/s)"
    )
    print(
        f"{'trace':<11} {'SLO (TTFT s, TPOT s)':<28} " + " ".join(f"{d:>10}" for d in DEPLOYMENTS)
    )
    maps: dict[str, list[dict[str, Any]]] = {}
    for trace in args.traces.split(","):
        per_dep = {d: rungs(trace, d, args.link_gbs) for d in DEPLOYMENTS}
        for slo, ttft, tpot in SLOS:
            g = {d: goodput(per_dep[d], ttft, tpot) / GPUS for d in DEPLOYMENTS}
            rows.append({"trace": trace, "slo": slo, "ttft": ttft, "tpot": tpot, **g})
            label = f"{slo} ({ttft:g}, {tpot:g})"
            print(f"{trace:<11} {label:<28} " + " ".join(f"{g[d]:>10.3f}" for d in DEPLOYMENTS),
                  flush=True)  # fmt: skip
        maps[trace] = winner_map(trace, per_dep)
    for trace, cells in maps.items():
        print(f"\nwinner map, {trace} (goodput per GPU of the best deployment):")
        print_map(cells)
        if args.plot_dir:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
            plot_map(cells, Path(args.plot_dir) / f"winner_{trace}.png")
    print("\nKV link bandwidth (arxiv, goodput per GPU at 'tight TPOT' / 'both relaxed'):")
    for link in (float(x) for x in args.links.split(",")):
        g = {}
        for d in DEPLOYMENTS[COLOCATED:]:
            ladder_ = rungs("arxiv", d, link)
            g[d] = [goodput(ladder_, t, p) / GPUS for name, t, p in SLOS if name != "tight TTFT"]
        rows.append({"study": "link", "link_gbs": link, **g})
        text = "  ".join(f"{d} {a:.3f} / {b:.3f}" for d, (a, b) in g.items())
        print(f"  {link:>6g} GB/s  {text}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "maps": maps}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
