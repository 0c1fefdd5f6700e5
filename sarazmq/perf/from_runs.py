"""A latency model fitted on the iterations of real runs (`sarazmq profile --from-runs`).

A replay's iterations.csv has every iteration's shape and its duration as the scheduler
saw it: from the plan being built to its result being processed (scheduling, transport,
the workers' forward and sampling). That is the time a token waits, so a model fitted on
it is the simulator's most faithful input on the machine that ran them. The gap between
one iteration's result and the next plan (result routing, inbound messages) is measured
too and kept as `overhead_s`, the simulator's per-iteration overhead.

The last run given is held out: the error reported on it is on a workload the fit never
saw.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sarazmq.perf.accuracy import prediction_error
from sarazmq.replay.report import ITERATIONS_CSV
from sarazmq.scheduler import IterationShape, fit_latency_model

#: gaps longer than this are idle time (no work), not per-iteration overhead
MAX_OVERHEAD_GAP_S = 0.05
_SHAPE_FIELDS = IterationShape.__struct_fields__


def read_iterations(run_dir: str | Path) -> tuple[list[IterationShape], np.ndarray, np.ndarray]:
    """(shapes, durations, gaps before back-to-back iterations) of one run directory;
    ValueError naming the file when it is missing or has no shape columns."""
    path = Path(run_dir) / ITERATIONS_CSV
    if not path.is_file():
        raise ValueError(f"--from-runs {run_dir}: no {ITERATIONS_CSV} (is it a replay output?)")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and not set(_SHAPE_FIELDS) <= rows[0].keys():
        raise ValueError(f"--from-runs {path}: no iteration shape columns (an older replay?)")
    shapes, durations, gaps = [], [], []
    prev_end = None
    for row in rows:
        start, end = float(row["start_s"]), float(row["end_s"])
        shapes.append(IterationShape(**{k: int(row[k]) for k in _SHAPE_FIELDS}))
        durations.append(end - start)
        if prev_end is not None and 0 <= start - prev_end <= MAX_OVERHEAD_GAP_S:
            gaps.append(start - prev_end)
        prev_end = end
    return shapes, np.asarray(durations), np.asarray(gaps)


def fit_from_runs(run_dirs: Sequence[str]) -> dict[str, Any]:
    """The profile JSON (as `sarazmq profile` writes it, kind "replayed") of a model fitted
    on every run but the last, with its error on the last (held out) and on its own
    training iterations."""
    if len(run_dirs) < 2:
        raise ValueError("--from-runs needs at least two runs: the last one is held out")
    train_shapes: list[IterationShape] = []
    train_secs: list[float] = []
    all_gaps: list[float] = []
    for d in run_dirs[:-1]:
        shapes, secs, gaps = read_iterations(d)
        keep = secs > 0
        train_shapes += [s for s, k in zip(shapes, keep) if k]
        train_secs += secs[keep].tolist()
        all_gaps += gaps.tolist()
    test_shapes, test_secs, test_gaps = read_iterations(run_dirs[-1])
    keep = test_secs > 0
    test_shapes = [s for s, k in zip(test_shapes, keep) if k]
    test_secs = test_secs[keep]
    if len(train_shapes) < 2 * len(_SHAPE_FIELDS) or not len(test_shapes):
        raise ValueError("--from-runs: too few iterations to fit and test a model")
    model = fit_latency_model(train_shapes, train_secs)
    return {
        "kind": "replayed",
        "timed": "scheduler iterations of real runs (plan built -> result processed); "
        "overhead_s: median gap between back-to-back iterations",
        "runs": {"train": list(run_dirs[:-1]), "test": run_dirs[-1]},
        "overhead_s": float(np.median(all_gaps)) if all_gaps else 0.0,
        "model": model.to_dict(),
        "error": {
            "train": prediction_error(model, train_shapes, train_secs).to_dict(),
            "test": prediction_error(model, test_shapes, test_secs.tolist()).to_dict(),
        },
        "num_iterations": {"train": len(train_shapes), "test": len(test_shapes)},
    }
