"""Random arrival processes and length distributions of synthetic workloads (seeded)."""

from __future__ import annotations

import math

import numpy as np


def poisson_arrivals(n: int, qps: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times [n] of a Poisson process at `qps`; the first request at 0."""
    return gamma_arrivals(n, qps, 1.0, rng)


def gamma_arrivals(n: int, qps: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times [n] whose gaps are gamma with mean 1/qps and coefficient of
    variation cv (shape 1/cv^2; cv=1 is Poisson, cv>1 bursty); the first request at 0."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"qps={qps} must be a finite number > 0")
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv={cv} must be a finite number > 0")
    if n == 0:
        return np.zeros(0)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (qps * shape), size=n - 1)  # [n-1], mean 1/qps
    return np.concatenate([[0.0], np.cumsum(gaps)])


def uniform_lengths(n: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """n integers [n] uniform on [lo, hi] (inclusive)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"range ({lo}, {hi}) must satisfy 1 <= lo <= hi")
    return rng.integers(lo, hi + 1, size=n)


def zipf_lengths(n: int, theta: float, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """n integers [n] on [lo, hi] with P(lo + k) proportional to (k + 1)^-theta: a bounded
    Zipf law, so the shortest lengths are the most frequent (any theta > 0 works)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"range ({lo}, {hi}) must satisfy 1 <= lo <= hi")
    if not theta > 0:
        raise ValueError(f"theta={theta} must be > 0")
    weights = np.arange(1, hi - lo + 2, dtype=np.float64) ** -theta  # [hi-lo+1]
    return lo + rng.choice(hi - lo + 1, size=n, p=weights / weights.sum())
