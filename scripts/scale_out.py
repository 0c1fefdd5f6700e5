"""Data-parallel fleets in simulation: routers compared at 8, 64 and 256 replicas, and the
replicas each router needs to meet an SLO (docs/SCALE_OUT.md).

Every replica is Mistral-7B on one A100-80GB (Vidur's measured A100 Llama-3-8B operator
table, the same layer shapes; `sarazmq simulate --gpu a100 --arch mistral-7b`), sarathi
with a 512-token budget, prefix caching on, its KV pool the GPU's memory less the
weights. Each trace is replayed at a speed scaled to the fleet: its arrival times divided
by replicas / `--per-replica` (so each replica sees the same load at every size), with as
many trace rows as the fleet takes (`--requests-per-replica` each, up to the whole trace).
Mooncake prompts carry their prefix-block hash ids (`--prefix-sharing`), so its shared
prefixes are real; Azure conversation prompts share nothing, which is the control.

The table prints per (trace, replicas, router): prefix-cache hit rate, P99 TTFT, P99 TBT,
busy fraction and the simulator's wall time; the ratio cache-aware / round-robin of the
hit rate and of P99 TTFT. `--capacity` adds, per router, the fewest replicas whose P99
TTFT and P99 TBT meet the SLO at a fixed trace speed (bisection over the fleet size).

Usage: python scripts/scale_out.py [--sizes 8,64,256] [--traces mooncake,azure_conv]
       [--capacity] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sarazmq.cli.sim_options import gpu_kv_blocks
from sarazmq.options import EngineOptions
from sarazmq.perf.load import load_latency_model
from sarazmq.replay.metrics import summarize
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.sim.fleet import simulate_fleet
from sarazmq.sim.run import sim_engine_config

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
TRACE_FILES = {
    "mooncake": TRACES / "mooncake_conversation_trace.jsonl",
    "azure_conv": TRACES / "azure_llm_2023_conv.csv",
}
ROUTERS = ("round-robin", "least-load", "cache-aware")
GPU, ARCH = "a100", "mistral-7b"
MAX_INPUT, MAX_OUTPUT = 16_384, 1_024
MAX_MODEL_LEN = MAX_INPUT + MAX_OUTPUT
# P99 TTFT SLOs for --capacity: Mooncake's longest prompts (16k tokens, 32 chunks of 512)
# take about 2 s to prefill on an idle replica, so its P99 cannot meet 2 s at any size
SLO_TTFT = {"mooncake": 4.0, "azure_conv": 2.0}


def workload(trace: str, replicas: int, per_replica: float, max_rows: int) -> list[WorkloadRequest]:
    """The trace's first rows (`max_rows`), sped up so each of `replicas` replicas sees
    1 / per_replica of the trace's own rate."""
    spec = WorkloadSpec(
        vocab_size=32000,
        trace_path=str(TRACE_FILES[trace]),
        max_requests=max_rows,
        prefix_sharing=trace == "mooncake",
        time_scale=per_replica / replicas,
        max_input_tokens=MAX_INPUT,
        max_output_tokens=MAX_OUTPUT,
    )
    return build_workload(spec)


def run(
    requests: list[WorkloadRequest], replicas: int, router: str, latency: Any
) -> dict[str, Any]:
    blocks = gpu_kv_blocks(GPU, ARCH, 1, 16)
    config = sim_engine_config(
        EngineOptions(data_parallel_size=replicas, router=router, chunk_size=512),
        num_blocks=blocks,
        max_model_len=MAX_MODEL_LEN,
    )
    t0 = time.perf_counter()
    out = simulate_fleet(requests, config, latency)
    wall = time.perf_counter() - t0
    s = summarize(out.records)
    fleet = out.fleet_summary()
    return {
        "replicas": replicas,
        "router": router,
        "requests": len(requests),
        "hit_rate": out.prefix_hit_rate,
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p99": s["ttft_s"]["p99"],
        "tbt_p99": s["tbt_s"]["p99"],
        "busy_mean": fleet["busy_fraction"]["mean"],
        "busy_max": fleet["busy_fraction"]["max"],
        "req_per_replica": fleet["requests_per_replica"],
        "sim_time_s": out.sim_time_s,
        "wall_s": wall,
    }


def replicas_needed(
    trace: str,
    router: str,
    latency: Any,
    speed: float,
    rows: int,
    slo: tuple[float, float],
    sizes: list[int],
) -> tuple[int, dict[str, Any]]:
    """The fewest of `sizes` replicas whose P99 TTFT and P99 TBT meet `slo` for the
    trace's first `rows` rows at `speed` x its own rate. Sizes are tried from the largest
    down, stopping at the first that fails: an overloaded fleet's queues make its
    simulation slow, so the search meets at most one of them. (0, {}) if none meets it."""
    best: tuple[int, dict[str, Any]] = (0, {})
    for n in sorted(sizes, reverse=True):
        reqs = workload(trace, n, n / speed, rows)  # time_scale = 1 / speed at every size
        r = run(reqs, n, router, latency)
        if not (r["ttft_p99"] <= slo[0] and r["tbt_p99"] <= slo[1]):
            break
        best = (n, r)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--traces", default="mooncake,azure_conv")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--requests-per-replica", type=int, default=150)
    ap.add_argument(
        "--per-replica",
        type=float,
        default=4.0,
        help="each replica sees the trace's rate / this (the trace sped up by replicas / it)",
    )
    ap.add_argument("--capacity", action="store_true", help="also the replicas each router needs")
    ap.add_argument("--skip-table", action="store_true", help="only --capacity")
    ap.add_argument("--capacity-speed", type=float, default=8.0, help="trace speed for --capacity")
    ap.add_argument("--capacity-rows", type=int, default=2000)
    ap.add_argument("--capacity-sizes", default="128,96,80,64,56,48,40,32,24,16,12,8,6,4")
    ap.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="P99 TTFT SLO (s); default per trace, about twice its longest prompt's "
        "prefill alone (SLO_TTFT)",
    )
    ap.add_argument("--slo-tbt", type=float, default=0.2)
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args()
    latency, _ = load_latency_model(None, GPU, ARCH)
    rows: list[dict[str, Any]] = []
    header = (
        f"{'trace':<11} {'replicas':>8} {'router':<12} {'requests':>8} {'hit rate':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TBT p99':>8} {'busy':>5} {'wall s':>7}"
    )
    print(header)
    for trace in [] if args.skip_table else args.traces.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            reqs = workload(trace, n, args.per_replica, args.requests_per_replica * n)
            by_router = {}
            for router in args.routers.split(","):
                r = {"trace": trace, **run(reqs, n, router, latency)}
                rows.append(r)
                by_router[router] = r
                print(
                    f"{trace:<11} {n:>8} {router:<12} {r['requests']:>8} "
                    f"{r['hit_rate']:>8.3f} {r['ttft_p50']:>9.3f} {r['ttft_p99']:>9.3f} "
                    f"{r['tbt_p99']:>8.3f} {r['busy_mean']:>5.2f} {r['wall_s']:>7.1f}",
                    flush=True,
                )
            if "cache-aware" in by_router and "round-robin" in by_router:
                ca, rr = by_router["cache-aware"], by_router["round-robin"]
                hit = f"{ca['hit_rate'] / rr['hit_rate']:.2f}x" if rr["hit_rate"] else "-"
                print(
                    f"{'':<11} {'':>8} cache-aware / round-robin: hit rate {hit}, "
                    f"P99 TTFT {ca['ttft_p99'] / rr['ttft_p99']:.2f}x",
                    flush=True,
                )
    if args.capacity:
        print(
            f"\nreplicas needed for P99 TTFT and P99 TBT <= {args.slo_tbt} s, the first "
            f"{args.capacity_rows} rows at {args.capacity_speed}x the trace's rate:"
        )
        for trace in args.traces.split(","):
            slo = (args.slo_ttft or SLO_TTFT[trace], args.slo_tbt)
            print(f"{trace}: P99 TTFT <= {slo[0]} s")
            for router in args.routers.split(","):
                sizes = [int(x) for x in args.capacity_sizes.split(",")]
                n, r = replicas_needed(
                    trace, router, latency, args.capacity_speed, args.capacity_rows, slo, sizes
                )
                if not n:
                    print(f"{trace:<11} {router:<12} none of {sizes} meets it", flush=True)
                    continue
                rows.append({"trace": trace, "capacity": n, **r})
                print(
                    f"{trace:<11} {router:<12} {n:>4} replicas (hit rate {r['hit_rate']:.3f}, "
                    f"TTFT p99 {r['ttft_p99']:.2f} s, TBT p99 {r['tbt_p99']:.3f} s)",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
