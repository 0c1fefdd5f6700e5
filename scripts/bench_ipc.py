"""Deployment vs in-process throughput, and the scheduler's own per-iteration overhead.

    python scripts/bench_ipc.py [--requests 32] [--max-tokens 64] [--skip-e2e]

Part 1 runs the same greedy workload through the multi-process deployment (client SDK
over ZeroMQ) and through the in-process `LLM`, and prints output tokens/s of both and
their ratio (goal: the deployment keeps >= 95%).

Part 2 measures what the scheduler process spends per iteration besides the model:
planning (policy + diff), encoding the plan, sending it to a worker and receiving the
result over real ipc sockets (the worker is a stub thread that answers at once), and
processing the result into per-detokenizer delta batches, at 64 and 256 running
requests (goal: < 1 ms at 256), with the scheduler process's garbage-collector settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import threading
import time

import msgspec
import zmq

from sarazmq.options import EngineOptions
from sarazmq.protocol.engine import AddRequest, DeltaBatch
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import (
    SchedulerActions,
    SchedulerService,
    build_scheduler,
    configure_scheduler_gc,
)
from sarazmq.sim.run import sim_engine_config

PROMPTS = [
    "Explain how a bicycle works.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of climate change?",
    "Give me a recipe for pancakes.",
    "Describe the water cycle for a ten-year-old.",
    "List some tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
]


def e2e(num_requests: int, max_tokens: int) -> tuple[float, float]:
    from sarazmq import LLM
    from sarazmq.client import Client
    from sarazmq.procs.launcher import Deployment

    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    options = EngineOptions(chunk_size=256, max_num_seqs=64, max_model_len=1024, num_kv_blocks=1024)

    llm = LLM(**dataclasses.asdict(options))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    inproc = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    del llm

    with Deployment(options.to_config()) as dep, Client(dep.endpoint) as c:
        c.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        results: list[int] = []
        t0 = time.perf_counter()
        threads = [
            threading.Thread(
                target=lambda p=p: results.append(len(c.generate(p, params).token_ids))
            )
            for p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deployed = sum(results) / (time.perf_counter() - t0)
    return inproc, deployed


def stub_worker(ctx: zmq.Context, plan_ep: str, result_ep: str, stop: threading.Event) -> None:
    """Answers every plan at once with one token per sampling sequence."""
    pull = ctx.socket(zmq.PULL)
    pull.bind(plan_ep)
    push = ctx.socket(zmq.PUSH)
    push.connect(result_ep)
    dec = msgspec.msgpack.Decoder(BatchPlan)
    enc = msgspec.msgpack.Encoder()
    while not stop.is_set():
        if not pull.poll(100):
            continue
        plan = dec.decode(pull.recv())
        ids = [s.seq_id for s in plan.scheduled if s.sample]
        push.send(enc.encode(StepResult(step=plan.step, seq_ids=ids, token_ids=[100] * len(ids))))
    pull.close(0)
    push.close(0)


def scheduler_overhead(num_running: int, iters: int = 300) -> dict[str, float]:
    # a scheduler without a model, resolved as the simulator resolves one
    options = EngineOptions(scheduler="sarathi", chunk_size=512, max_num_seqs=num_running)
    config = sim_engine_config(options, num_blocks=num_running * 40, max_model_len=4096)
    sched = build_scheduler(config, eos_token_ids=(2,))
    service = SchedulerService(sched, num_detokenizers=2)
    params = SamplingParams(temperature=0, max_tokens=100_000 // 1, ignore_eos=True)
    acts = SchedulerActions()
    for i in range(num_running):
        service.on_inbound(AddRequest(f"r{i}", list(range(10, 42)), params, time.monotonic()), acts)
    ctx = zmq.Context()
    d = tempfile.mkdtemp(prefix="sarazmq-bench-")
    plan_ep, result_ep = f"ipc://{d}/plan.ipc", f"ipc://{d}/result.ipc"
    results = ctx.socket(zmq.PULL)
    results.bind(result_ep)
    plans = ctx.socket(zmq.PUSH)
    plans.connect(plan_ep)
    stop = threading.Event()
    worker = threading.Thread(target=stub_worker, args=(ctx, plan_ep, result_ep, stop))
    worker.start()
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(StepResult)
    delta_enc = msgspec.msgpack.Encoder()
    phases: dict[str, list[float]] = {
        "plan": [],
        "encode+send+recv": [],
        "process+route": [],
        "total": [],
    }
    for it in range(iters + 20):
        t0 = time.perf_counter()
        plan = service.next_plan()
        t1 = time.perf_counter()
        plans.send(enc.encode(plan))
        result = dec.decode(results.recv())
        t2 = time.perf_counter()
        acts = SchedulerActions()
        service.on_result(result, acts)
        for msgs in acts.to_detokenizers.values():
            for m in msgs:
                if isinstance(m, DeltaBatch):
                    delta_enc.encode(m)
        t3 = time.perf_counter()
        if it >= 20:  # skip the prefill iterations and warm-up
            phases["plan"].append(t1 - t0)
            phases["encode+send+recv"].append(t2 - t1)
            phases["process+route"].append(t3 - t2)
            phases["total"].append(t3 - t0)
    stop.set()
    worker.join()
    plans.close(0)
    results.close(0)
    ctx.term()
    assert sched.stats().num_running == num_running
    return {k: statistics.median(v) * 1e3 for k, v in phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()

    # as the scheduler process does at startup (part 1's deployment sets its own)
    configure_scheduler_gc()
    print("scheduler overhead per iteration (median ms; decode-only iterations)")
    print(
        f"{'running':>8} {'plan':>8} {'enc+send+recv':>14} {'process+route':>14} {'total':>8} {'goal':>6}"
    )
    for n in (64, 256):
        r = scheduler_overhead(n)
        print(
            f"{n:>8} {r['plan']:>8.3f} {r['encode+send+recv']:>14.3f} {r['process+route']:>14.3f} "
            f"{r['total']:>8.3f} {'<1 ms':>6}"
        )
    if args.skip_e2e:
        return
    inproc, deployed = e2e(args.requests, args.max_tokens)
    print()
    print(f"throughput, {args.requests} requests x {args.max_tokens} tokens, greedy")
    print(f"{'engine':<28} {'output tok/s':>12}")
    print(f"{'in-process LLM (baseline)':<28} {inproc:>12.1f}")
    print(f"{'multi-process deployment':<28} {deployed:>12.1f}")
    print(f"{'ratio deployment/in-process':<28} {deployed / inproc:>12.3f}   (goal >= 0.95)")


if __name__ == "__main__":
    main()
