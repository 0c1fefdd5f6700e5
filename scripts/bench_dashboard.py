#!/usr/bin/env python
"""What watching costs: the same workload with nobody on /dashboard and with viewers.

A dashboard viewer makes the API server ask the scheduler for its stats and new iteration
records every `interval` seconds (one poll serves every viewer). The scheduler answers
between iterations, so the cost lands on its loop. Two measurements, in one run:

1. In process: the scheduler-side work of one poll (stats + the iteration records since
   the last poll, as dicts) against a scheduler holding `--records` records.
2. End to end: one deployment, the workload replayed through the HTTP API `--rounds`
   times alternately without and with `--viewers` viewers (the server polls every 0.5 s):
   output tok/s and mean iteration time, and their ratios.

    python scripts/bench_dashboard.py [--requests 24] [--rounds 2] [--viewers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

import httpx
import msgspec

from sarazmq import Client
from sarazmq.api.dashboard import DashboardSettings
from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig, SchedulerConfig
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment
from sarazmq.replay.openai_driver import replay_openai
from sarazmq.replay.workload import WorkloadSpec, build_workload
from sarazmq.scheduler import Scheduler
from sarazmq.scheduler.stats import IterationRecord

MODEL = "smollm2-135m-instruct"


def poll_cost_us(num_records: int, per_poll: int, repeats: int = 2000) -> float:
    """Microseconds the scheduler spends answering one dashboard poll."""
    sched = Scheduler(SchedulerConfig(), 16, 1024, 2048, (0,))
    for step in range(1, num_records + 1):
        sched.iteration_records.append(
            IterationRecord(step, step * 0.01, step * 0.01 + 0.008, 100, 28, 29, 1, 28)
        )
    since = num_records - per_poll + 1
    t0 = time.perf_counter()
    for _ in range(repeats):
        out: dict[str, Any] = msgspec.structs.asdict(sched.stats())
        out["iterations"] = [msgspec.structs.asdict(r) for r in sched.iterations_since(since)]
        msgspec.msgpack.encode(out)
    return (time.perf_counter() - t0) / repeats * 1e6


def watch(root: str, stop: threading.Event) -> None:
    """One viewer: reads /dashboard/events until stopped."""
    with httpx.Client(base_url=root, timeout=None) as client:
        with client.stream("GET", "/dashboard/events") as events:
            for _ in events.iter_lines():
                if stop.is_set():
                    return


def run_once(root: str, engine: Client, requests: list, viewers: int) -> tuple[float, float]:
    """(output tok/s, mean iteration seconds) of one replay with `viewers` watching; the
    iterations are the scheduler's records of the run (read over ZeroMQ)."""
    engine.reset_prefix_cache()  # every run computes every prompt (they repeat)
    first_step = int(engine.stats()["num_iterations"]) + 1
    stop = threading.Event()
    threads = [threading.Thread(target=watch, args=(root, stop)) for _ in range(viewers)]
    for t in threads:
        t.start()
    out = asyncio.run(replay_openai(f"{root}/v1", MODEL, requests, progress=False, warmup=False))
    stop.set()
    for t in threads:
        t.join(timeout=10)
    tokens = sum(r.num_output_tokens for r in out.records)
    its = engine.stats(iterations_from=first_step)["iterations"]
    return tokens / out.wall_s, statistics.fmean(i["end"] - i["start"] for i in its)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--viewers", type=int, default=3)
    ap.add_argument("--records", type=int, default=200_000)
    args = ap.parse_args()

    # per poll: the iterations of one interval at ~100 iterations/s
    interval = DashboardSettings().interval_s
    per_poll = max(1, int(100 * interval))
    cost = poll_cost_us(args.records, per_poll)

    spec = WorkloadSpec(
        vocab_size=49152,
        avoid_ids=(0, 1, 2),
        lengths="uniform",
        input_range=(64, 512),
        output_range=(16, 48),
        arrivals="all_at_once",
        max_requests=args.requests,
        seed=5,
    )
    requests = build_workload(spec)
    config = EngineConfig(
        dtype="float32",
        scheduler=SchedulerConfig(chunk_size=256, max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks=2048),
    )
    port = free_tcp_port()
    results: dict[int, list[tuple[float, float]]] = {0: [], args.viewers: []}
    with (
        Deployment(config, DeploymentConfig(http_port=port)) as dep,
        Client(dep.endpoint) as engine,
    ):
        root = f"http://127.0.0.1:{port}"
        run_once(root, engine, requests, 0)  # warm-up: every shape of the workload once
        for _ in range(args.rounds):
            for viewers in (0, args.viewers):
                results[viewers].append(run_once(root, engine, requests, viewers))
    base_tps = statistics.fmean(r[0] for r in results[0])
    base_it = statistics.fmean(r[1] for r in results[0])
    seen_tps = statistics.fmean(r[0] for r in results[args.viewers])
    seen_it = statistics.fmean(r[1] for r in results[args.viewers])
    print(f"one poll, scheduler side ({per_poll} new records, {args.records} kept): "
          f"{cost:.0f} us = {cost / 1e6 / base_it:.4f} of a mean iteration, "
          f"{cost / 1e6 / interval:.5f} of the scheduler's time at one poll per "
          f"{interval} s")  # fmt: skip
    print()
    print("| viewers | output tok/s | mean iteration (ms) | tok/s ratio | iteration ratio |")
    print("|---|---|---|---|---|")
    print(f"| 0 | {base_tps:.1f} | {1000 * base_it:.1f} | 1.00 | 1.00 |")
    print(f"| {args.viewers} | {seen_tps:.1f} | {1000 * seen_it:.1f} | "
          f"{seen_tps / base_tps:.3f} | {seen_it / base_it:.3f} |")  # fmt: skip
    print(f"({args.rounds} alternating rounds of {args.requests} requests each)")


if __name__ == "__main__":
    main()
