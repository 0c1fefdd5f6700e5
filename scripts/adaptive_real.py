"""The SLO-aware budget on the real engine: one workload, fixed chunks against --tbt-slo.

Replays the same Azure conversation window on a fresh deployment per configuration
(fixed chunk 64, 128, 256; the adaptive budget at each --slo with chunk 1024 as its upper
bound) and prints, per configuration and SLO: P99 TBT, the share of TBT samples over the
SLO, the share of requests whose own P99 TBT is over it, TTFT P50/P99, output tokens/s,
and the latency model's error the server reports. Resumable (a finished run is kept).

Usage: python scripts/adaptive_real.py [--out DIR] [--slos 0.15,0.3] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

TRACE = str(
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
)
WORKLOAD = [
    TRACE, "--start", "3000", "--time-scale", "5", "--length-scale", "0.25",
    "--max-input-tokens", "1536", "--max-output-tokens", "128", "--no-progress",
]  # fmt: skip
FIXED = (64, 128, 256)
UPPER = 1024


def run(out: Path, name: str, extra: list[str], n: int) -> dict:
    d = out / name
    if not (d / "summary.json").is_file():
        cmd = [sys.executable, "-m", "sarazmq.cli", "replay", *WORKLOAD, "--max-requests", str(n)]
        print("$ sarazmq replay ... " + " ".join(extra), flush=True)
        subprocess.run([*cmd, *extra, "--output-dir", str(d)], check=True)
    return json.loads((d / "summary.json").read_text())


def tbt_samples(run_dir: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """All TBT gaps and each request's gaps, from records.jsonl."""
    per_req = []
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if not rec["error"]:
            per_req.append(np.diff(np.asarray(rec["token_times_s"])))
    return np.concatenate(per_req), per_req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="adaptive_real_out")
    ap.add_argument("--slos", default="0.15,0.3")
    ap.add_argument("--requests", type=int, default=120)
    args = ap.parse_args()
    out = Path(args.out)
    slos = [float(x) for x in args.slos.split(",")]
    configs = {f"fixed-{c}": ["--chunk-size", str(c)] for c in FIXED}
    for slo in slos:
        configs[f"adaptive-{slo:g}"] = ["--chunk-size", str(UPPER), "--tbt-slo", str(slo)]
    summaries = {name: run(out, name, extra, args.requests) for name, extra in configs.items()}
    print(
        f"\n{'config':<15} {'SLO s':>5} {'TBT p99 ms':>10} {'TBT>SLO':>8} {'req p99>SLO':>11} "
        f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'out tok/s':>9} {'model MAPE':>10}"
    )
    for slo in slos:
        for name, s in summaries.items():
            if name.startswith("adaptive") and name != f"adaptive-{slo:g}":
                continue
            gaps, per_req = tbt_samples(out / name)
            over = float((gaps > slo).mean())
            req_over = float(np.mean([np.percentile(g, 99) > slo for g in per_req if g.size]))
            budget = s.get("adaptive_budget") or {}
            mape = f"{budget['latency_model_mape'] * 100:.1f} %" if budget else "-"
            print(
                f"{name:<15} {slo:>5.2f} {s['tbt_s']['p99'] * 1e3:>10.0f} {over:>8.1%} "
                f"{req_over:>11.1%} {s['ttft_s']['p50'] * 1e3:>11.0f} "
                f"{s['ttft_s']['p99'] * 1e3:>11.0f} "
                f"{s['throughput']['output_tokens_per_s']:>9.1f} {mape:>10}"
            )


if __name__ == "__main__":
    main()
