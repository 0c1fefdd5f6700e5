"""The int8 KV cache against the model's own, in process at saturation: output tok/s.

    python scripts/bench_kv_int8.py [--pairs 2] [--prompt 256] [--output 384] [--dtype float32]

Each repetition runs, in fresh processes one after the other, `LLM(kv_cache_dtype="auto")`
and `LLM(kv_cache_dtype="int8")` (otherwise the engine's defaults: on an AVX2 CPU a GGUF
model in float32 with int8 matmuls) on the same 64 requests of `--prompt` random tokens
and `--output` generated ones (ignore_eos), all admitted at once: after their prefill
every iteration decodes 64 sequences whose contexts grow to prompt + output keys, so a
longer output is a more decode-bound run. Prints each run and int8 / auto per pair
(> 1: the int8 cache is faster) and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

REQUESTS = 64
BLOCK = 16

# one measurement in a fresh process: arguments kv_cache_dtype, prompt, output, dtype
_CHILD = f"""
import json, random, sys, time
from sarazmq import LLM, SamplingParams
kv, prompt, output, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range({REQUESTS})]
blocks = {REQUESTS} * (-(-(prompt + output) // {BLOCK}) + 1) + 64
llm = LLM(dtype=dtype, kv_cache_dtype=kv, max_num_seqs={REQUESTS}, num_kv_blocks=blocks)
llm.generate([p[:32] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
t0 = time.perf_counter()
outs = llm.generate(prompts, params)
seconds = time.perf_counter() - t0
print(json.dumps({{"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds,
                  "gguf_matmul": llm.engine.config.gguf_matmul}}))
"""


def measure(kv_cache_dtype: str, prompt: int, output: int, dtype: str) -> dict:
    """One run in a fresh process: {"tokens", "seconds", "gguf_matmul"}."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, kv_cache_dtype, str(prompt), str(output), dtype],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise SystemExit(f"the {kv_cache_dtype} run failed: {why}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="alternated (auto, int8) pairs")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=384, help="generated tokens per request")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    for name in ("pairs", "prompt", "output"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be >= 1")
    print(
        f"{REQUESTS} requests x {args.prompt} prompt tokens, {args.output} output tokens, "
        f"dtype {args.dtype}, fresh process per run, alternated\n"
    )
    print("| pair | KV cache | GGUF matmuls | output tok/s | int8 / auto |")
    print("|---|---|---|---|---|")
    ratios = []
    for pair in range(1, args.pairs + 1):
        rates = {}
        for kv in ("auto", "int8"):
            run = measure(kv, args.prompt, args.output, args.dtype)
            rates[kv] = run["tokens"] / run["seconds"]
            ratio = f"{rates['int8'] / rates['auto']:.2f}x" if kv == "int8" else ""
            print(f"| {pair} | {kv} | {run['gguf_matmul']} | {rates[kv]:.1f} | {ratio} |")
        ratios.append(rates["int8"] / rates["auto"])
    print(f"\nint8 / auto, median of {len(ratios)} pairs: {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
