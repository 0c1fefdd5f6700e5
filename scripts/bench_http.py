"""Output tokens/s and TTFT through the HTTP API against the ZeroMQ SDK, in the same run.

Starts one deployment serving both (`--http-port`), then for each concurrency (1, 16, 64
streams by default) runs the same requests (fixed random token-id prompts, ignore_eos,
`--output-tokens` each) through the SDK and through `/v1/completions` with streaming,
alternating the two `--rounds` times, and prints a table: output tok/s of each, their
ratio, the median TTFT of each (client-side) and the HTTP server's added median TTFT.

    python scripts/bench_http.py --concurrency 1,16,64 --rounds 3

Goal (issue 14): HTTP >= 0.9x the SDK's tok/s at 64 streams and < 5 ms added median TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from sarazmq.client import AsyncClient
from sarazmq.config import DeploymentConfig
from sarazmq.options import EngineOptions
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment
from sarazmq.sampling_params import SamplingParams


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


async def run_sdk(endpoint: str, batch: list[list[int]], out_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    async with AsyncClient(endpoint) as client:

        async def one(p: list[int]) -> tuple[int, float]:
            t0 = time.perf_counter()
            ttft, n = None, 0
            async for d in client.stream(p, params):
                if ttft is None and d.token_ids:
                    ttft = time.perf_counter() - t0
                n += len(d.token_ids)
            return n, ttft or 0.0

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p) for p in batch))
        return time.perf_counter() - t0, res


async def run_http(root: str, batch: list[list[int]], out_tokens: int) -> tuple[float, list]:
    limits = httpx.Limits(max_connections=len(batch) + 8)
    async with httpx.AsyncClient(base_url=root, timeout=600, limits=limits) as c:

        async def one(p: list[int]) -> tuple[int, float]:
            body = {"prompt": p, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            t0 = time.perf_counter()
            ttft, n = None, 0
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and ttft is None:
                        ttft = time.perf_counter() - t0
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            return n, ttft or 0.0

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p) for p in batch))
        return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    port = free_tcp_port()
    config = EngineOptions(
        dtype=args.dtype,
        num_threads=args.threads,
        chunk_size=256,
        max_num_seqs=max(levels),
        max_model_len=1024,
        num_kv_blocks=max(levels) * 8 + 64,
    ).to_config()
    rows = []
    with Deployment(config, DeploymentConfig(http_port=port)) as dep:
        root = f"http://127.0.0.1:{port}"
        asyncio.run(run_sdk(dep.endpoint, prompts(2, 16, 0), 4))  # warm-up both paths
        asyncio.run(run_http(root, prompts(2, 16, 0), 4))
        for n in levels:
            batch = prompts(n, args.input_tokens, n)
            sdk_tps, http_tps, sdk_ttft, http_ttft = [], [], [], []
            for _ in range(args.rounds):
                wall, res = asyncio.run(run_sdk(dep.endpoint, batch, args.output_tokens))
                sdk_tps.append(sum(r[0] for r in res) / wall)
                sdk_ttft.append(statistics.median(r[1] for r in res))
                wall, res = asyncio.run(run_http(root, batch, args.output_tokens))
                http_tps.append(sum(r[0] for r in res) / wall)
                http_ttft.append(statistics.median(r[1] for r in res))
            rows.append((n, statistics.median(sdk_tps), statistics.median(http_tps),
                         statistics.median(sdk_ttft), statistics.median(http_ttft)))  # fmt: skip
    print(f"\n{args.rounds} rounds, {args.input_tokens} in / {args.output_tokens} out, "
          f"dtype {args.dtype}; medians")  # fmt: skip
    header = (f"{'streams':>8} {'SDK tok/s':>10} {'HTTP tok/s':>11} {'HTTP/SDK':>9} "
              f"{'SDK TTFT ms':>12} {'HTTP TTFT ms':>13} {'added ms':>9}")  # fmt: skip
    print(header)
    for n, s, h, st, ht in rows:
        print(f"{n:>8} {s:>10.1f} {h:>11.1f} {h / s:>8.2f}x {st * 1e3:>12.1f} "
              f"{ht * 1e3:>13.1f} {(ht - st) * 1e3:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
