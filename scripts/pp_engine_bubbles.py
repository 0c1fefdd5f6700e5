"""Pipeline bubbles and throughput of the real engine (worker processes) on this machine.

For each policy and pipeline size, starts a deployment of the default model with the
machine's cores split evenly over the tp x pp workers, sends one burst of requests
(same prompts and lengths for every row), and reports the bubble fraction over the run
(`sarazmq.scheduler.stats.bubble_fraction` of its iterations), each stage's busy share,
and output tokens/s. Usage:

    python scripts/pp_engine_bubbles.py --policies sarathi,vllm --pp 1,2 --requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

from sarazmq.client import Client
from sarazmq.options import EngineOptions
from sarazmq.procs.launcher import Deployment
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import IterationRecord, active_seconds, bubble_fraction

WORDS = "the a of river mountain quickly green seven under over silent bright old".split()


def prompts(n: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randrange(min_words, max_words)))
        for _ in range(n)
    ]


def run(policy: str, pp: int, args: argparse.Namespace) -> dict[str, object]:
    cores = os.cpu_count() or 1
    config = EngineOptions(
        pipeline_parallel_size=pp,
        num_threads=max(1, cores // pp),
        scheduler=policy,
        chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        block_size=16,
        num_kv_blocks=args.num_blocks,
    ).to_config()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    texts = prompts(args.requests, args.seed, args.min_words, args.max_words)
    with Deployment(config) as dep, Client(dep.endpoint) as client:
        start_step = client.stats()["num_iterations"] + 1
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(texts)) as pool:
            outs = list(pool.map(lambda t: client.generate(t, params), texts))
        wall = time.monotonic() - t0
        stats = client.stats(iterations_from=start_step)
    records = [IterationRecord(**r) for r in stats["iterations"]]  # type: ignore[arg-type]
    active = active_seconds((r.start, r.end) for r in records)
    busy = [sum(r.stage_busy_s[s] for r in records if len(r.stage_busy_s) > s) for s in range(pp)]
    return {
        "policy": policy,
        "pp": pp,
        "threads_per_worker": config.num_threads,
        "iterations": len(records),
        "bubble_fraction": round(bubble_fraction(records, pp), 4),
        "stage_busy_share": [round(b / active, 3) for b in busy] if active else [],
        "out_tok_s": round(sum(len(o.token_ids) for o in outs) / wall, 1),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="sarathi,vllm")
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-words", type=int, default=20)
    ap.add_argument("--max-words", type=int, default=400)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    rows = []
    for policy in args.policies.split(","):
        for pp in (int(x) for x in args.pp.split(",")):
            row = run(policy, pp, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
