"""How far a latency model's predictions are from measured iteration times."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sarazmq.scheduler import IterationShape


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
