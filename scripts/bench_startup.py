"""Start-up time against a baseline commit, measured in one run, alternated.

    python scripts/bench_startup.py --baseline ccda2d7 [--reps 3]

The baseline commit is checked out into a temporary git worktree and installed (no
dependencies, no build isolation) into a temporary folder that goes first on PYTHONPATH
for its runs; the checkout's own runs use this venv's install. Each repetition times,
for the baseline and then the checkout, in fresh processes started from a neutral
folder:

- `LLM(dtype="float32")` on the default model (its default KV pool): the constructor
  alone, after `from sarazmq import LLM`;
- `sarazmq serve --dtype float32` from the command to its "sarazmq serving" line (every
  process ready), then SIGTERM.

Prints the medians and baseline / checkout (> 1: the checkout starts faster).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLM_CODE = (
    "import time\nfrom sarazmq import LLM\nt = time.perf_counter()\nLLM(dtype='float32')\n"
    "print(time.perf_counter() - t)"
)


def install_baseline(rev: str, into: Path) -> Path:
    """The package of commit `rev`, installed into `into`/pkg; the folder to put on
    PYTHONPATH."""
    tree, pkg = into / "tree", into / "pkg"
    added = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        capture_output=True,
        text=True,
    )
    if added.returncode != 0:
        raise SystemExit(
            f"--baseline {rev!r}: not a commit of this checkout ({added.stderr.strip()})"
        )
    try:
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "--target", str(pkg), str(tree)],
        )  # fmt: skip
        if installed.returncode != 0:
            raise SystemExit(f"--baseline {rev!r}: pip could not install that commit")
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            check=False,
            capture_output=True,
        )
    return pkg


def env_for(pythonpath: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def time_llm(pythonpath: str, cwd: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LLM_CODE],
        env=env_for(pythonpath),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[-1])


def time_serve(pythonpath: str, cwd: str) -> float:
    cmd = [sys.executable, "-m", "sarazmq.cli", "serve", "--dtype", "float32", "--endpoint"]
    cmd.append(f"ipc://{cwd}/startup-{time.monotonic_ns()}.ipc")
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env_for(pythonpath),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    up = time.perf_counter() - t
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    if "sarazmq serving" not in line:
        raise SystemExit(f"serve did not start ({pythonpath or 'checkout'}): {line!r}")
    return up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git commit to compare with")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = str(install_baseline(args.baseline, Path(tmp)))
        neutral = tempfile.mkdtemp(dir=tmp)  # no checkout on sys.path
        runs: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            for name, path in (("baseline", base), ("checkout", "")):
                llm, serve = time_llm(path, neutral), time_serve(path, neutral)
                runs.setdefault((name, "llm"), []).append(llm)
                runs.setdefault((name, "serve"), []).append(serve)
                print(f"rep {rep} {name}: LLM() {llm:.2f} s, serve {serve:.2f} s", flush=True)
    print(f"\n| start-up (median of {args.reps}, alternated) | {args.baseline} | checkout | "
          f"{args.baseline} / checkout |")  # fmt: skip
    print("|---|---|---|---|")
    labels = {
        "llm": "`LLM(dtype='float32')`, default KV pool",
        "serve": "`sarazmq serve --dtype float32` to 'sarazmq serving'",
    }
    for key, label in labels.items():
        b = statistics.median(runs[("baseline", key)])
        c = statistics.median(runs[("checkout", key)])
        print(f"| {label} | {b:.1f} s | {c:.1f} s | {b / c:.2f}x |")


if __name__ == "__main__":
    main()
