"""The piecewise-linear iteration latency model, its non-negative fit, and its error report.

time = c0
     + c_tok * max(num_tokens, knee)       linear layers: below the knee a step is bound by
                                           reading the weights (flat), above it by FLOPs
     + c_pairs * prefill_attention_pairs   prefill attention (causal (query, key) pairs)
     + c_ctx * decode_context_tokens       decode attention (KV positions read)
     + c_seq * num_seqs                    per-sequence work (metadata, gathers, sampling)
     + c_sampled * num_sampled             LM head rows and sampling

Every coefficient is >= 0 (each term is a cost), so the fit is a non-negative least squares
problem, weighted so that it minimises relative error (short decode steps count as much as
long prefills), with the knee chosen by grid search.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sarazmq.perf.shape import IterationShape

KIND = "piecewise_linear"
COEFFICIENTS = ("c0", "c_tok", "c_pairs", "c_ctx", "c_seq", "c_sampled")


@dataclass(frozen=True)
class PiecewiseLinearModel:
    """A LatencyModel: seconds of one iteration from its shape (see the module docstring)."""

    knee: int = 1
    c0: float = 0.0
    c_tok: float = 0.0
    c_pairs: float = 0.0
    c_ctx: float = 0.0
    c_seq: float = 0.0
    c_sampled: float = 0.0

    def __post_init__(self) -> None:
        if self.knee < 0:
            raise ValueError(f"knee={self.knee} must be >= 0")
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be finite and >= 0")

    def predict(self, shape: IterationShape) -> float:
        """Seconds; plain arithmetic (cheap enough for a scheduler's per-candidate calls).
        An empty shape (no tokens) costs nothing."""
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        if tokens == 0:
            return 0.0
        return (
            self.c0
            + self.c_tok * (tokens if tokens > self.knee else self.knee)
            + self.c_pairs * shape.prefill_attention_pairs
            + self.c_ctx * shape.decode_context_tokens
            + self.c_seq * (shape.num_prefill_seqs + shape.num_decode_seqs)
            + self.c_sampled * shape.num_sampled
        )

    def predict_many(self, shapes: Sequence[IterationShape]) -> np.ndarray:
        """Seconds of each shape (vectorised; the same numbers as `predict`)."""
        x = features(shapes, self.knee)
        out = x @ self.coefficients()
        out[x[:, 0] == 0] = 0.0
        return out

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in COEFFICIENTS], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PiecewiseLinearModel:
        """The model of `to_dict`'s output; ValueError naming what is missing or wrong."""
        if data.get("kind") != KIND:
            raise ValueError(f"not a {KIND} model (kind={data.get('kind')!r})")
        missing = [k for k in ("knee", *COEFFICIENTS) if k not in data]
        if missing:
            raise ValueError(f"{KIND} model lacks {', '.join(missing)}")
        return cls(knee=int(data["knee"]), **{k: float(data[k]) for k in COEFFICIENTS})


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


@dataclass(frozen=True)
class ErrorReport:
    """Absolute percentage errors of predictions (|pred - true| / true * 100).

    bias_pct: the mean signed error (positive = the model predicts too long)."""

    n: int
    mape: float
    p50_abs_pct_error: float
    p95_abs_pct_error: float
    p99_abs_pct_error: float
    max_abs_pct_error: float
    bias_pct: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"n={self.n} MAPE {self.mape:.1f}% P50 {self.p50_abs_pct_error:.1f}% "
            f"P95 {self.p95_abs_pct_error:.1f}% max {self.max_abs_pct_error:.1f}% "
            f"bias {self.bias_pct:+.1f}%"
        )


def prediction_error(
    model: Any, shapes: Sequence[IterationShape], seconds: Sequence[float]
) -> ErrorReport:
    """How far `model` (any LatencyModel) is from the measured `seconds` of `shapes`."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError(f"need matching, non-empty shapes ({len(shapes)}) and times")
    y = np.asarray(seconds, dtype=np.float64)
    if not (y > 0).all():
        raise ValueError("measured times must be > 0")
    pred = np.array([model.predict(s) for s in shapes], dtype=np.float64)
    signed = (pred - y) / y * 100.0
    err = np.abs(signed)
    return ErrorReport(
        n=len(y),
        mape=float(err.mean()),
        p50_abs_pct_error=float(np.percentile(err, 50)),
        p95_abs_pct_error=float(np.percentile(err, 95)),
        p99_abs_pct_error=float(np.percentile(err, 99)),
        max_abs_pct_error=float(err.max()),
        bias_pct=float(signed.mean()),
    )
