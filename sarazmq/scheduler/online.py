"""A latency model that keeps learning: refitted from the iterations the engine runs.

`OnlineLatencyModel` wraps the piecewise-linear fit (`fit_latency_model`):

- `observe(shape, seconds, gap_s)` records one measured iteration. Before it is added,
  the current model's prediction for it is scored, so the error figures (`error()`) are
  always out of sample;
- every `refit_every` observations it refits on a sliding window of the most recent
  `window` iterations (the window is the smoothing: one noisy iteration moves a fit of
  hundreds only a little), after dropping outliers: samples whose residual under a first
  fit is beyond `OUTLIER_MADS` median absolute deviations (a preempted process, a page
  fault storm);
- `margin` is 1 + the P99 of the recent relative under-predictions (actual / predicted
  - 1), so the budget's safety factor follows the model's measured error instead of
  being set by hand. P99, not P95: the target is on the P99 of the time between tokens,
  and the iterations the budget sizes are those that end right at the target, so their
  time may be under-predicted in at most about 1 % of them. Stalls (an iteration over 3x
  its prediction and an outlier by the fit's rule) are left out: no chunk size avoids
  them, so they must not shrink every chunk;
- `overhead_s` is the smoothed gap between one iteration's result and the next plan
  (result handling, scheduling, IPC): time a token waits that the iteration shape does
  not explain.

The first iterations of a fresh process are slow for reasons no shape explains (lazy
initialisation), so the first `warmup` observations are ignored.

Until a fit exists it predicts with the prior (a loaded profile), or 0 (no model yet:
the budget then uses its upper bound).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from sarazmq.scheduler.latency import COEFFICIENTS, LatencyModel
from sarazmq.scheduler.latency_fit import fit_latency_model
from sarazmq.scheduler.shape import IterationShape

OUTLIER_MADS = 6.0
#: Bounds of the error margin: at least the prediction itself, at most 3x it.
MIN_MARGIN = 1.0
MAX_MARGIN = 3.0
#: An under-prediction is only a stall (left out of the margin) beyond this relative error
#: (3x the prediction) as well as beyond OUTLIER_MADS: the fit's own heavy tail must stay
#: in the margin.
MIN_STALL_ERROR = 2.0
#: The margin is recomputed every this many observations (a percentile per iteration
#: would cost more than the scheduling it guards).
MARGIN_EVERY = 8
#: Weight of a new gap in the overhead's moving average.
GAP_SMOOTHING = 0.05


@dataclass(frozen=True)
class OnlineError:
    """Out-of-sample prediction error over the recent iterations.

    mape: mean |actual - predicted| / actual; p95_abs_pct: its P95; both fractions."""

    num_samples: int
    mape: float
    p95_abs_pct: float


class OnlineLatencyModel:
    """Iteration-time predictions, refitted online (see the module docstring)."""

    def __init__(
        self,
        prior: LatencyModel | None = None,
        *,
        window: int = 1024,
        refit_every: int = 64,
        min_samples: int = 12,
        error_window: int = 512,
        warmup: int = 8,
    ) -> None:
        if window < min_samples or min_samples < len(COEFFICIENTS) or refit_every < 1:
            raise ValueError(
                f"window={window} >= min_samples={min_samples} >= {len(COEFFICIENTS)} (the "
                f"model's coefficients) and refit_every={refit_every} >= 1 are required"
            )
        self.prior = prior
        self.warmup = warmup
        self._seen = 0
        self.fitted: LatencyModel | None = None
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.num_refits = 0
        self._shapes: deque[IterationShape] = deque(maxlen=window)
        self._seconds: deque[float] = deque(maxlen=window)
        self._rel_errors: deque[float] = deque(maxlen=error_window)  # actual/pred - 1
        self._since_refit = 0
        self._overhead = 0.0
        self._num_gaps = 0
        self._margin = MIN_MARGIN

    @property
    def current(self) -> LatencyModel | None:
        """The model predictions come from (the fit, else the prior, else None)."""
        return self.fitted if self.fitted is not None else self.prior

    def predict(self, shape: IterationShape) -> float:
        model = self.current
        return model.predict(shape) if model is not None else 0.0

    @property
    def margin(self) -> float:
        return self._margin

    @property
    def overhead_s(self) -> float:
        return self._overhead

    @property
    def num_samples(self) -> int:
        return len(self._seconds)

    def observe(self, shape: IterationShape, seconds: float, gap_s: float | None = None) -> None:
        """One measured iteration (and the idle-free gap before it, when known). The
        first `warmup` iterations of a process are ignored: lazy initialisation (kernel
        builds, first allocations) makes them many times slower than the rest."""
        self._seen += 1
        if not seconds > 0 or self._seen <= self.warmup:
            return
        model = self.current
        if model is not None:
            predicted = model.predict(shape)
            if predicted > 0:
                self._rel_errors.append(seconds / predicted - 1.0)
                self._update_margin()
        if gap_s is not None and gap_s >= 0:
            self._num_gaps += 1
            w = max(GAP_SMOOTHING, 1.0 / self._num_gaps)  # plain mean for the first ones
            self._overhead += w * (gap_s - self._overhead)
        self._shapes.append(shape)
        self._seconds.append(seconds)
        self._since_refit += 1
        if self._since_refit >= self.refit_every and len(self._seconds) >= self.min_samples:
            self.refit()

    def refit(self) -> bool:
        """Refits on the window now; False when there are too few samples."""
        self._since_refit = 0
        if len(self._seconds) < self.min_samples:
            return False
        shapes = list(self._shapes)
        secs = np.asarray(self._seconds, dtype=np.float64)
        first = fit_latency_model(shapes, secs)
        pred = np.array([first.predict(s) for s in shapes])
        resid = secs - pred
        mad = float(np.median(np.abs(resid - np.median(resid)))) or 1e-12
        keep = np.abs(resid) <= OUTLIER_MADS * 1.4826 * mad
        if keep.sum() >= self.min_samples and not keep.all():
            first = fit_latency_model([s for s, k in zip(shapes, keep) if k], secs[keep])
        self.fitted = first
        self.num_refits += 1
        return True

    def error(self) -> OnlineError:
        errs = np.abs(np.asarray(self._rel_errors, dtype=np.float64))
        if errs.size == 0:
            return OnlineError(0, 0.0, 0.0)
        # relative to the actual time: |a - p| / a = |r| / (1 + r) with r = a/p - 1
        rel = errs / (1.0 + np.asarray(self._rel_errors))
        return OnlineError(int(errs.size), float(rel.mean()), float(np.percentile(rel, 95)))

    def _update_margin(self) -> None:
        if len(self._rel_errors) < self.min_samples or self._seen % MARGIN_EVERY:
            return
        r = np.asarray(self._rel_errors)
        # stalls no chunk size avoids (a descheduled process) are outliers here as in the
        # fit: they must not shrink every chunk
        dev = np.abs(r - np.median(r))
        mad = float(np.median(dev))
        r = r[dev <= max(OUTLIER_MADS * 1.4826 * mad, MIN_STALL_ERROR)]
        p99 = float(np.percentile(r, 99))
        self._margin = min(MAX_MARGIN, max(MIN_MARGIN, 1.0 + p99))
