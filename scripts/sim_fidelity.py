"""Simulator fidelity on this machine: simulated vs replayed serving of untuned workloads.

1. replays every workload below on a real deployment (`sarazmq replay`, default engine);
2. builds two latency models of this machine: the grid profile (`sarazmq profile`: 45
   shapes timed on the engine, no workload) and a fit on the first workload's iterations,
   held out on the second (`sarazmq profile --from-runs`);
3. simulates every other workload with each model (`sarazmq simulate --profile`), with
   the real run's KV pool and context, and prints simulated / replayed for P50/P99 TBT,
   P50/P99 TTFT and output throughput.

Resumable: a workload whose replay (or simulation) folder has a summary.json is not run
again. Usage: python scripts/sim_fidelity.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
CONV = str(TRACES / "azure_llm_2023_conv.csv")
CODE = str(TRACES / "azure_llm_2023_code.csv")
MOONCAKE = str(TRACES / "mooncake_conversation_trace.jsonl")

# name -> (trace, fitting flags). The first one trains the model, none was tuned on.
WORKLOADS: dict[str, list[str]] = {
    "conv-train": [CONV, "--start", "0", "--time-scale", "5", "--length-scale", "0.25"],
    "conv-later": [CONV, "--start", "9000", "--time-scale", "8", "--length-scale", "0.25"],
    "code-bursty": [CODE, "--start", "4000", "--time-scale", "10", "--length-scale", "0.3"],
    "mooncake": [MOONCAKE, "--start", "500", "--time-scale", "3", "--length-scale", "0.04"],
}
COMMON = ["--max-input-tokens", "1536", "--max-output-tokens", "128", "--no-progress"]
METRICS = (
    ("TBT p50 (ms)", ("tbt_s", "p50"), 1e3),
    ("TBT p99 (ms)", ("tbt_s", "p99"), 1e3),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), 1e3),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), 1e3),
    ("output tok/s", ("throughput", "output_tokens_per_s"), 1.0),
)


def sarazmq(*args: str) -> None:
    cmd = [sys.executable, "-m", "sarazmq.cli", *args]
    print("$ sarazmq " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def value(summary: dict, path: tuple[str, ...]) -> float:
    node = summary
    for key in path:
        node = node[key]
    return float(node)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fidelity_out")
    ap.add_argument("--requests", type=int, default=150, help="requests per workload")
    args = ap.parse_args()
    out = Path(args.out)
    n = ["--max-requests", str(args.requests)]
    for name, flags in WORKLOADS.items():
        run = out / "real" / name
        if not (run / "summary.json").is_file():
            sarazmq("replay", *flags, *COMMON, *n, "--output-dir", str(run))
    names = list(WORKLOADS)
    models = {"grid": out / "grid_profile.json", "runs": out / "fit.json"}
    if not models["grid"].is_file():
        sarazmq("profile", "--output", str(models["grid"]))
    if not models["runs"].is_file():
        sarazmq(
            "profile", "--output", str(models["runs"]),
            "--from-runs", str(out / "real" / names[0]),
            "--from-runs", str(out / "real" / names[1]),
        )  # fmt: skip
    rows = []
    for name in names[1:]:
        real = json.loads((out / "real" / name / "summary.json").read_text())
        engine = real["settings"]["engine"]
        sims = {}
        for model, path in models.items():
            sim_dir = out / f"sim-{model}" / name
            if not (sim_dir / "summary.json").is_file():
                sarazmq(
                    "simulate", *WORKLOADS[name], *COMMON, *n,
                    "--profile", str(path), "--output-dir", str(sim_dir), "--no-plots",
                    "--num-kv-blocks", str(engine["cache"]["num_blocks"]),
                    "--max-model-len", str(engine["scheduler"]["max_model_len"]),
                )  # fmt: skip
            sims[model] = json.loads((sim_dir / "summary.json").read_text())
        for label, path, scale in METRICS:
            r = value(real, path) * scale
            rows.append((name, label, r, *(value(sims[m], path) * scale / r for m in models)))
    for model, path in models.items():
        err = json.loads(path.read_text())["error"]["test"]
        print(
            f"latency model '{model}': held-out iteration error MAPE {err['mape']:.1f} %, "
            f"P95 {err['p95_abs_pct_error']:.1f} %"
        )
    print(f"\n{'workload':<12} {'metric':<14} {'replayed':>10} {'grid/real':>10} {'runs/real':>10}")
    for name, label, r, grid, runs in rows:
        print(f"{name:<12} {label:<14} {r:>10.1f} {grid:>10.2f} {runs:>10.2f}")
    for i, model in enumerate(models):
        worst = max(abs(row[3 + i] - 1) for row in rows)
        print(f"worst |sim/real - 1| with the {model} model: {worst * 100:.0f} %")


if __name__ == "__main__":
    main()
