"""Asynchronous scheduling against synchronous, on the multi-process deployment.

    python scripts/bench_async.py [--runs 3] [--requests 16] [--max-tokens 64]
        [--model M --load-format dummy | --model tiny] [--threads N]

Two deployments of the same engine, one with `--async-scheduling` (the scheduler
builds plan N+1 while the worker runs plan N), served the same workloads in turns
(sync, async, sync, ...; the median run of each is printed):

- decode: `--requests` short prompts at once, `--max-tokens` greedy tokens each;
- mixed: the same with every fourth prompt ~600 tokens long (chunked prefills with
  decodes piggybacked).

Per mode: output tokens/s; the worker's idle time between iterations (the time with a
plan in flight, less its forward time, per iteration: what asynchronous scheduling
hides); the worker's busy fraction; inter-token latency P50/P99 from the server's token
times; and the ratio async / sync of each, measured in the same run. Greedy tokens are
compared between the modes (float32: the same tokens).

`--model tiny`: a random-weight 2-layer Llama (`sarazmq.model.tiny`) whose forward takes
about a millisecond, so the host's share of a step is what it is on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sarazmq.client import Client
from sarazmq.model.tiny import write_tiny_llama
from sarazmq.options import EngineOptions
from sarazmq.procs.launcher import Deployment
from sarazmq.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ipc import PROMPTS  # noqa: E402  (the same chat prompts as the IPC bench)

LONG = "The history of the printing press is a story of cheaper books and faster ideas. " * 36


def prompts(kind: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)] + f" ({i})"
        out.append(LONG + p if kind == "mixed" and i % 4 == 0 else p)
    return out


def run_once(client: Client, texts: list[str], params: SamplingParams) -> dict[str, Any]:
    """Serves `texts` at once; tokens/s, ITL percentiles and the worker's idle gap."""
    before = client.stats()
    first_step = before["num_iterations"] + 1
    outs: dict[int, Any] = {}

    def one(i: int) -> None:
        outs[i] = client.generate(texts[i], params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stats = client.stats(iterations_from=first_step)
    records = stats["iterations"]
    # the span with a plan in flight: first plan sent to the last result in
    active = records[-1]["end"] - records[0]["start"]
    forward = sum(r["forward_s"] for r in records)
    itl = sorted(b - a for o in outs.values() for a, b in zip(o.token_times, o.token_times[1:]))
    tokens = sum(len(o.token_ids) for o in outs.values())
    return {
        "tok_s": tokens / wall,
        "gap_ms": 1e3 * max(active - forward, 0.0) / len(records),
        "busy": forward / active if active > 0 else 0.0,
        "itl_p50_ms": 1e3 * itl[len(itl) // 2],
        "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
        "iterations": len(records),
        "tokens": [outs[i].token_ids for i in range(len(texts))],
    }


METRICS = [
    ("tok_s", "output tok/s", "{:.1f}"),
    ("gap_ms", "worker idle ms/iter", "{:.2f}"),
    ("busy", "worker busy fraction", "{:.3f}"),
    ("itl_p50_ms", "ITL P50 ms", "{:.2f}"),
    ("itl_p99_ms", "ITL P99 ms", "{:.2f}"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=EngineOptions.model)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="worker torch threads (0: all)")
    ap.add_argument("--workloads", default="decode,mixed")
    args = ap.parse_args()
    model = args.model
    if model == "tiny":
        model = write_tiny_llama(Path(tempfile.mkdtemp(prefix="sarazmq-tiny-")))
    base = dict(
        model=model,
        load_format=args.load_format,
        dtype=args.dtype,
        gguf_matmul="float",
        chunk_size=256,
        max_num_seqs=max(args.requests, 8),
        max_model_len=2048,
        num_kv_blocks=max(256, args.requests * 64),
        num_threads=args.threads,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"sync": False, "async": True}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with (
        Deployment(EngineOptions(**base, async_scheduling=False).to_config()) as d_sync,
        Deployment(EngineOptions(**base, async_scheduling=True).to_config()) as d_async,
        Client(d_sync.endpoint) as c_sync,
        Client(d_async.endpoint) as c_async,
    ):
        clients = {"sync": c_sync, "async": c_async}
        for c in clients.values():  # warm-up
            c.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
        for kind in args.workloads.split(","):
            texts = prompts(kind, args.requests)
            for _ in range(args.runs):
                for mode in modes:
                    results.setdefault((kind, mode), []).append(
                        run_once(clients[mode], texts, params)
                    )
    print(
        f"model {args.model} ({args.load_format}, {args.dtype}), {args.requests} requests x "
        f"{args.max_tokens} tokens, median of {args.runs} runs per mode, modes in turns"
    )
    print(f"{'workload':8} {'metric':22} {'sync':>10} {'async':>10} {'async/sync':>11}")
    same = True
    for kind in args.workloads.split(","):
        for key, label, fmt in METRICS:
            med = {m: statistics.median(r[key] for r in results[(kind, m)]) for m in modes}
            ratio = med["async"] / med["sync"] if med["sync"] else float("nan")
            print(
                f"{kind:8} {label:22} {fmt.format(med['sync']):>10} "
                f"{fmt.format(med['async']):>10} {ratio:>11.2f}"
            )
        same &= all(
            r["tokens"] == results[(kind, "sync")][0]["tokens"]
            for m in modes
            for r in results[(kind, m)]
        )
    print(f"greedy tokens identical across modes and runs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
