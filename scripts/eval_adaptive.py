"""The SLO-aware budget against every fixed chunk, in simulation (issue 16's tables).

For each latency model (this machine's engine from a `sarazmq profile` JSON, and
Mistral-7B on an A100 from Vidur's tables) and each TBT SLO, the capacity (highest
Poisson rate with P99 TBT <= SLO and median scheduling delay <= 2 s) of:
- the sarathi policy with every fixed chunk of the grid, and
- the adaptive budget (--tbt-slo SLO, chunk 2048 as its upper bound), untuned;
on a steady workload (a share of long prompts) and on one whose long-prompt share
changes midway (0 % then 40 %). Prints capacity per chunk, the best fixed chunk, and
adaptive / best fixed.

Usage: python scripts/eval_adaptive.py [--cpu-profile P.json] [--requests N] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sarazmq.perf.load import load_latency_model
from sarazmq.replay.capacity import find_capacity
from sarazmq.replay.metrics import summarize
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sim.run import simulate_workload
from sarazmq.sweep.mix import LengthSource, MixSpec, build_mixed_workload

CHUNKS = (64, 128, 256, 512, 1024, 2048)
UPPER = 2048
SCHED_DELAY_SLO = 2.0


def changing_share(spec: MixSpec, qps: float, seed: int) -> list[WorkloadRequest]:
    """First half of the requests with no long prompt, second half 40 % long."""
    half = dataclasses.replace(spec, num_requests=spec.num_requests // 2)
    first = build_mixed_workload(half, share=0.0, qps=qps, seed=seed)
    second = build_mixed_workload(half, share=0.4, qps=qps, seed=seed + 1)
    t0 = first[-1].arrival_s + 1.0 / qps
    shifted = [
        dataclasses.replace(r, request_id=f"late-{i}", arrival_s=t0 + r.arrival_s)
        for i, r in enumerate(second)
    ]
    return first + shifted


def capacity(
    workload: Callable[[float], Sequence[WorkloadRequest]],
    latency: Any,
    geometry: dict[str, int],
    overhead_s: float,
    sched_kw: dict[str, Any],
    slo: float,
    lo: float,
) -> float:
    def run_at(qps: float) -> dict[str, Any]:
        out = simulate_workload(
            workload(qps), sched_kw, latency, seed=0, overhead_s=overhead_s, **geometry
        )
        return summarize(out.records, out.iterations)

    res = find_capacity(
        run_at, slo, SCHED_DELAY_SLO, lo, 2 * lo, max_iters=10, rel_tol=0.04, growth=2.0
    )
    return res.capacity_qps or 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-profile", default=None, help="this machine's latency profile")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--out", default="adaptive_out.json")
    args = ap.parse_args()
    setups = []
    if args.cpu_profile:
        model, info = load_latency_model(args.cpu_profile, None, None)
        cpu_mix = MixSpec(
            vocab_size=32000,
            short=LengthSource(trace_path=str(_trace("azure_llm_2023_conv.csv"))),
            long=LengthSource(trace_path=str(_trace(_ARXIV))),
            num_requests=args.requests,
            length_scale=0.25,
            max_input_tokens=1536,
            max_output_tokens=128,
        )
        # the default engine's pool and context on this machine; its max_num_seqs
        geo = {"block_size": 16, "num_blocks": 7478, "max_model_len": 8192}
        setups.append(("CPU (this machine)", model, info, geo, cpu_mix, (0.15, 0.3, 0.6), 0.1, 64))
    model, info = load_latency_model(None, "a100", "mistral-7b")
    gpu_mix = MixSpec(
        vocab_size=32000,
        short=LengthSource(trace_path=str(_trace("azure_llm_2023_conv.csv"))),
        long=LengthSource(trace_path=str(_trace(_ARXIV))),
        num_requests=args.requests,
    )
    geo = {"block_size": 16, "num_blocks": 27551, "max_model_len": 8192}
    setups.append(("A100 Mistral-7B", model, info, geo, gpu_mix, (0.05, 0.1, 0.2), 0.5, 128))
    results = []
    for name, latency, info, geo, mix, slos, lo, seqs in setups:
        overhead = float(info.get("overhead_s", 0.0))
        loads = {
            "steady 25 % long": lambda q, m=mix: build_mixed_workload(m, share=0.25, qps=q, seed=0),
            "0 % then 40 % long": lambda q, m=mix: changing_share(m, q, 0),
        }
        for wname, workload in loads.items():
            for slo in slos:
                fixed = {}
                for c in CHUNKS:
                    kw = {"scheduler": "sarathi", "chunk_size": c, "max_num_seqs": seqs}
                    fixed[c] = capacity(workload, latency, geo, overhead, kw, slo, lo)
                kw = {"scheduler": "sarathi", "chunk_size": UPPER, "max_num_seqs": seqs}
                adaptive = capacity(
                    workload, latency, geo, overhead, {**kw, "tbt_slo": slo}, slo, lo
                )
                best = max(fixed, key=lambda c: fixed[c])
                row = {
                    "engine": name,
                    "workload": wname,
                    "slo_s": slo,
                    "fixed": fixed,
                    "best_chunk": best,
                    "adaptive": adaptive,
                    "ratio": adaptive / fixed[best] if fixed[best] else float("inf"),
                    "vs_256": adaptive / fixed[256] if fixed[256] else float("inf"),
                }
                results.append(row)
                print(_line(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + "\n".join(_line(r) for r in results))


_ARXIV = "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"


def _trace(name: str) -> Path:
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces" / name


def _line(r: dict[str, Any]) -> str:
    fixed = " ".join(f"{c}:{q:.2f}" for c, q in r["fixed"].items())
    return (
        f"{r['engine']:<19} {r['workload']:<19} SLO {r['slo_s']:.2f} s | fixed {fixed} | "
        f"best {r['best_chunk']} | adaptive {r['adaptive']:.2f} = {r['ratio']:.2f}x best, "
        f"{r['vs_256']:.2f}x chunk 256"
    )


if __name__ == "__main__":
    main()
