"""Deployment shapes on this machine, through the HTTP API, both cores each: one engine
(`--dp 1`, two threads), two data-parallel replicas (`--dp 2`, one thread each, per
router), and a disaggregated deployment (`--disaggregate`, one prefill and one decode
instance, one thread each), on an Azure conversation window, an Azure code window and a
Mooncake window (docs/SCALE_OUT.md and docs/DISAGGREGATION.md, "On this machine").

Each configuration is a `Deployment` of the default model serving the OpenAI API; the
same client (`replay_openai`, streaming /v1/completions, the trace's own arrival times
stretched to this machine) replays the same window against it. The prefix-cache hit rate
and the KV moved are the engine's own counters (its stats after the run less those
before). Mooncake prompts are built from the trace's prefix-block hash ids
(`prefix_sharing`), scaled to this model's context, so conversations share history.

Prints one table: output tok/s, TTFT p50/p99, P99 TBT (time between tokens), hit rate,
the KV moved per request and the mean pull time over the mean TTFT (disaggregated), and
each row's output tok/s and P99 TTFT over `--dp 1`'s in the same run. Run it on a quiet
machine (~45 minutes on 2 cores):
    python scripts/serving_modes.py [--requests 60] [--windows azure_conv,mooncake]
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
    "azure_code": (TRACES / "azure_llm_2023_code.csv", 4000, 14.0, 1.0, 1500, 128, False),
    "mooncake": (TRACES / "mooncake_conversation_trace.jsonl", 0, 6.0, 0.08, 2048, 128, True),
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


def serve_and_replay(requests: list[Any], shape: str, router: str) -> dict[str, Any]:
    """shape: "dp1" (one engine, two threads), "dp2" (two replicas) or "pd" (one prefill
    and one decode instance), one thread per instance."""
    port = free_tcp_port()
    opts: dict[str, Any] = {"router": router, "seed": 0, "num_threads": 2 if shape == "dp1" else 1}
    if shape == "dp2":
        opts["data_parallel_size"] = 2
    elif shape == "pd":
        opts.update(disaggregate=True, prefill_instances=1, decode_instances=1)
    config = EngineOptions(**opts).to_config()
    with Deployment(config, DeploymentConfig(http_port=port)) as dep:
        with Client(dep.endpoint) as client:
            before = client.stats()
        out = asyncio.run(
            replay_openai(f"http://127.0.0.1:{port}/v1", config.model, requests, progress=False)
        )
        with Client(dep.endpoint) as client:
            after = client.stats()
    s = summarize(out.records)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    pulls = delta("kv_pulls")
    return {
        "shape": shape,
        "router": router if shape == "dp2" else "-",
        "kv_mb_per_request": delta("kv_pull_bytes") / pulls / 1e6 if pulls else 0.0,
        "pull_over_ttft": (delta("kv_pull_seconds") / pulls) / s["ttft_s"]["mean"]
        if pulls
        else 0.0,
        "output_tok_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p99": s["ttft_s"]["p99"],
        "tbt_p99": s["tbt_s"]["p99"],
        "hit_rate": hits / queries if queries else 0.0,
        "completed": s["num_completed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--windows", default="azure_conv,azure_code,mooncake")
    ap.add_argument("--routers", default="round-robin,least-load,cache-aware")
    args = ap.parse_args()
    from sarazmq.replay.vocabulary import prompt_vocabulary

    vocab, avoid = prompt_vocabulary(EngineOptions().model, 0, "auto")
    print(
        f"{'window':<11} {'shape':<5} {'router':<12} {'done':>5} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TBT p99':>8} {'hit rate':>8} {'KV MB/req':>9} "
        f"{'pull/TTFT':>9} {'tok/s vs dp1':>12} {'TTFT99 vs dp1':>13}"
    )
    for name in args.windows.split(","):
        reqs = window(name, args.requests, vocab, avoid)
        base = serve_and_replay(reqs, "dp1", "least-load")
        rows = [base] + [serve_and_replay(reqs, "dp2", r) for r in args.routers.split(",")]
        rows.append(serve_and_replay(reqs, "pd", "least-load"))
        for r in rows:
            print(
                f"{name:<11} {r['shape']:<5} {r['router']:<12} {r['completed']:>5} "
                f"{r['output_tok_s']:>9.1f} {r['ttft_p50']:>9.3f} {r['ttft_p99']:>9.3f} "
                f"{r['tbt_p99']:>8.3f} {r['hit_rate']:>8.3f} {r['kv_mb_per_request']:>9.2f} "
                f"{r['pull_over_ttft']:>9.3f} "
                f"{r['output_tok_s'] / base['output_tok_s']:>11.2f}x "
                f"{r['ttft_p99'] / base['ttft_p99']:>12.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
