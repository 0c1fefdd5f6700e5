"""Fitting the piecewise-linear latency model (`latency.PiecewiseLinearModel`) to measured
iterations: a non-negative least squares problem, weighted so that it minimises relative
error (short decode steps count as much as long prefills), with the knee chosen by grid
search. Every coefficient is >= 0 (each term is a cost).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sarazmq.scheduler.latency import COEFFICIENTS, PiecewiseLinearModel
from sarazmq.scheduler.shape import IterationShape


def predict_many(model: PiecewiseLinearModel, shapes: Sequence[IterationShape]) -> np.ndarray:
    """Seconds of each shape under `model` (vectorised; the same numbers as `predict`)."""
    x = features(shapes, model.knee)
    out = x @ np.asarray(model.coefficients(), dtype=np.float64)
    out[x[:, 0] == 0] = 0.0
    return out


def features(shapes: Sequence[IterationShape], knee: int) -> np.ndarray:
    """The model's feature matrix (one row per shape, columns as COEFFICIENTS); the constant
    column is 0 for an empty shape."""
    raw = np.array(
        [
            (
                s.num_prefill_tokens + s.num_decode_seqs,
                s.prefill_attention_pairs,
                s.decode_context_tokens,
                s.num_prefill_seqs + s.num_decode_seqs,
                s.num_sampled,
            )
            for s in shapes
        ],
        dtype=np.float64,
    ).reshape(-1, 5)
    tokens = raw[:, 0]
    const = (tokens > 0).astype(np.float64)
    return np.column_stack([const, np.maximum(tokens, knee) * const, raw[:, 1:]])


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    if b.shape != (m,):
        raise ValueError(f"b has shape {b.shape}, expected ({m},)")
    max_iter = 3 * n if max_iter is None else max_iter
    tol = 10 * np.finfo(np.float64).eps * max(m, n) * max(1.0, float(np.abs(a).sum(0).max()))
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ b
    iters = 0
    while (~passive).any() and w[~passive].max() > tol:
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all() or iters >= max_iter:
                break
            iters += 1
            # step from x toward z until the first passive variable hits 0
            neg = passive & (z <= 0)
            gap = x[neg] - z[neg]  # >= 0; 0 only for a variable at 0 with z = 0
            alpha = float(np.min(np.where(gap > 0, x[neg] / np.where(gap > 0, gap, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = np.where(passive, np.maximum(z, 0.0), 0.0)
        w = a.T @ (b - a @ x)
        if iters >= max_iter:
            break
    return x


def default_knees(shapes: Sequence[IterationShape]) -> list[int]:
    """Knee candidates: 1 (no flat part) and powers of two up to the largest token count."""
    top = max((s.num_tokens for s in shapes), default=1)
    knees = [1]
    k = 2
    while k < top:
        knees.append(k)
        k *= 2
    return knees


def fit_latency_model(
    shapes: Sequence[IterationShape],
    seconds: Sequence[float],
    knees: Sequence[int] | None = None,
    relative: bool = True,
) -> PiecewiseLinearModel:
    """The best non-negative model for these measured iterations.

    knees: the knee candidates (default: `default_knees`); the one with the least weighted
    squared error wins. relative: weight each iteration by 1 / its time, minimising squared
    relative error rather than letting the longest iterations dominate.
    """
    if len(shapes) != len(seconds):
        raise ValueError(f"{len(shapes)} shapes but {len(seconds)} times")
    if len(shapes) < len(COEFFICIENTS):
        raise ValueError(f"need >= {len(COEFFICIENTS)} iterations to fit, got {len(shapes)}")
    y = np.asarray(seconds, dtype=np.float64)
    if not (np.isfinite(y).all() and (y > 0).all()):
        raise ValueError("iteration times must be finite and > 0")
    weight = 1.0 / y if relative else np.ones_like(y)
    best: tuple[float, PiecewiseLinearModel] | None = None
    for knee in knees if knees is not None else default_knees(shapes):
        x = features(shapes, int(knee)) * weight[:, None]
        # columns scaled to unit size: the solver's tolerance then means the same for all
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, y * weight) / scale
        err = float(np.sum((x @ coef - y * weight) ** 2))
        if best is None or err < best[0]:
            values = dict(zip(COEFFICIENTS, (float(c) for c in coef)))
            best = (err, PiecewiseLinearModel(knee=int(knee), **values))
    if best is None:
        raise ValueError("knees is empty")
    return best[1]
