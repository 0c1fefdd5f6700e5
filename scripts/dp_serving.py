"""Data-parallel replicas on this machine, through the HTTP API: `--dp 2` (one thread
each) against `--dp 1` (both cores), per router, on an Azure conversation window and a
Mooncake window (docs/SCALE_OUT.md, "On this machine").

Each configuration is a `Deployment` of the default model serving the OpenAI API; the
same client (`replay_openai`, streaming /v1/completions, the trace's own arrival times
stretched to this machine) replays the same window against it; the prefix-cache hit rate
is the engine's own (its stats after the run, less those before). Mooncake prompts are
built from the trace's prefix-block hash ids (`prefix_sharing`), scaled to this model's
context (`--length-scale`), so conversations really share their history.

Prints one table: output tok/s, TTFT p50/p99, P99 TBT (time between tokens), hit rate,
and each row's output tok/s and P99 TTFT over `--dp 1`'s in the same run. Run it on a
quiet machine (~20 minutes on 2 cores):
    python scripts/dp_serving.py [--requests 120] [--routers round-robin,cache-aware]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from sarazmq.client import Client
from sarazmq.config import DeploymentConfig
from sarazmq.options import EngineOptions
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment
from sarazmq.replay.metrics import summarize
from sarazmq.replay.openai_driver import replay_openai
from sarazmq.replay.workload import WorkloadSpec, build_workload

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
# name -> (trace, first row, time stretch, length scale, max prompt, max output, sharing)
WINDOWS: dict[str, tuple[Path, int, float, float, int, int, bool]] = {
    "azure_conv": (TRACES / "azure_llm_2023_conv.csv", 9000, 14.0, 1.0, 1024, 128, False),
    "mooncake": (TRACES / "mooncake_conversation_trace.jsonl", 0, 0.5, 0.08, 2048, 128, True),
}


def window(name: str, requests: int, vocab: int, avoid: tuple[int, ...]) -> list[Any]:
    path, start, stretch, scale, max_in, max_out, sharing = WINDOWS[name]
    spec = WorkloadSpec(
        vocab_size=vocab,
        avoid_ids=avoid,
        trace_path=str(path),
        start=start,
        max_requests=requests,
        time_scale=stretch,
        length_scale=scale,
        max_input_tokens=max_in,
        max_output_tokens=max_out,
        prefix_sharing=sharing,
    )
    return build_workload(spec)


def serve_and_replay(
    requests: list[Any], replicas: int, router: str, threads: int
) -> dict[str, Any]:
    port = free_tcp_port()
    config = EngineOptions(
        data_parallel_size=replicas, router=router, num_threads=threads, seed=0
    ).to_config()
    with Deployment(config, DeploymentConfig(http_port=port)) as dep:
        with Client(dep.endpoint) as client:
            before = client.stats()
        out = asyncio.run(
            replay_openai(f"http://127.0.0.1:{port}/v1", config.model, requests, progress=False)
        )
        with Client(dep.endpoint) as client:
            after = client.stats()
    s = summarize(out.records)
    queries = after["prefix_cache_queries"] - before.get("prefix_cache_queries", 0)
    hits = after["prefix_cache_hits"] - before.get("prefix_cache_hits", 0)
    return {
        "replicas": replicas,
        "router": router if replicas > 1 else "-",
        "output_tok_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p99": s["ttft_s"]["p99"],
        "tbt_p99": s["tbt_s"]["p99"],
        "hit_rate": hits / queries if queries else 0.0,
        "completed": s["num_completed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--windows", default="azure_conv,mooncake")
    ap.add_argument("--routers", default="round-robin,least-load,cache-aware")
    args = ap.parse_args()
    from sarazmq.replay.vocabulary import prompt_vocabulary

    vocab, avoid = prompt_vocabulary(EngineOptions().model, 0, "auto")
    print(
        f"{'window':<11} {'dp':>2} {'router':<12} {'done':>5} {'out tok/s':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TBT p99':>8} {'hit rate':>8} {'tok/s vs dp1':>12} {'TTFT99 vs dp1':>13}"
    )
    for name in args.windows.split(","):
        reqs = window(name, args.requests, vocab, avoid)
        base = serve_and_replay(reqs, 1, "round-robin", 2)
        rows = [base] + [serve_and_replay(reqs, 2, r, 1) for r in args.routers.split(",")]
        for r in rows:
            print(
                f"{name:<11} {r['replicas']:>2} {r['router']:<12} {r['completed']:>5} "
                f"{r['output_tok_s']:>9.1f} {r['ttft_p50']:>9.3f} {r['ttft_p99']:>9.3f} "
                f"{r['tbt_p99']:>8.3f} {r['hit_rate']:>8.3f} "
                f"{r['output_tok_s'] / base['output_tok_s']:>11.2f}x "
                f"{r['ttft_p99'] / base['ttft_p99']:>12.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
