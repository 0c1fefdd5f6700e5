"""SLO-aware token budget: each iteration's chunk from a time-between-tokens target.

With `SchedulerConfig.tbt_slo` set, the sarathi policy asks `AdaptiveBudget` for each
iteration's token budget instead of using `chunk_size`:

- every running decode has a deadline for the token this iteration makes: its token k
  (0-based, the first token at t_first) is due at t_first + k * slo, and no later than
  slo after its previous token (the target is on each gap, P99 TBT, so slack a decode
  banked by running ahead of schedule is not spent on one long gap);
- the budget is the largest prefill chunk, from tile-aligned candidates up to
  `chunk_size` minus the decodes, whose predicted iteration time (the online latency
  model, times its error margin, plus the measured gap between iterations) fits the
  smallest slack; the candidates are searched by bisection (the prediction grows with
  the chunk);
- with no slack left a minimum chunk still runs, so prefills never starve; with no
  decodes running the budget is `chunk_size`.

The latency model starts from a `sarazmq profile` JSON (`latency_profile`) or from a
short calibration: a few internal requests (`CALIBRATION_ID_PREFIX`) run first with
budgets cycling through the candidate sizes, so the first fit sees a spread of chunk
sizes, decode counts and contexts. Their outputs are dropped. After that the model is
refitted online from every measured iteration (`OnlineLatencyModel`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sarazmq.config import SchedulerConfig
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.latency import profile_model
from sarazmq.scheduler.request import Request
from sarazmq.scheduler.shape import IterationShape, chunk_attention_pairs

if TYPE_CHECKING:
    # numpy comes with it: loaded only when a TBT target builds a budget
    from sarazmq.scheduler.online import OnlineLatencyModel

#: Chunk candidates are multiples of this (the GEMM / attention kernels' row tile).
TILE_TOKENS = 16
#: The chunk that runs even when no decode has slack left.
MIN_CHUNK_TOKENS = 32
#: Internal calibration requests: ids start with this; their outputs are dropped.
CALIBRATION_ID_PREFIX = "__sarazmq-calibrate-"
CALIBRATION_REQUESTS = 8
CALIBRATION_OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class BudgetStats:
    """What the budget did so far (for stats and the replay summary)."""

    num_iterations: int = 0
    num_limited: int = 0  # iterations whose chunk the slack cut below the upper bound
    num_min_chunk: int = 0  # iterations with no slack left (the minimum chunk ran)
    mean_chunk: float = 0.0  # mean prefill budget of iterations with decodes running


class AdaptiveBudget:
    """The token budget of each iteration under a TBT target (see the module docstring)."""

    def __init__(
        self,
        tbt_slo: float,
        upper: int,
        model: OnlineLatencyModel,
        clock: Callable[[], float],
        *,
        calibrating: bool = False,
    ) -> None:
        if not tbt_slo > 0:
            raise ValueError(f"tbt_slo={tbt_slo} must be > 0")
        if upper < 1:
            raise ValueError(f"upper={upper} must be >= 1")
        self.tbt_slo = tbt_slo
        self.upper = upper
        self.model = model
        self.clock = clock
        self.calibrating = calibrating
        sizes = sorted({min(upper, s) for s in (32, 64, 128, 256, 512, 1024, 2048, upper)})
        self._explore = itertools.cycle(sizes)
        self._iterations = self._with_decodes = self._limited = self._min_chunk = 0
        self._chunk_sum = 0.0
        self._last_end: float | None = None

    @staticmethod
    def calibration_prompt_len(upper: int, max_tokens: int) -> int:
        """Prompt length of the calibration requests: a few chunks of the largest
        candidate, within the model's context."""
        return max(1, min(2 * upper, 1024, max_tokens - CALIBRATION_OUTPUT_TOKENS))

    def slack(self, decodes: list[Request], now: float) -> float:
        """Seconds until the earliest deadline among the decodes (inf without any)."""
        slo = self.tbt_slo
        best = float("inf")
        for req in decodes:
            times = req.token_times
            if not times:
                continue
            due = min(times[0] + len(times) * slo, times[-1] + slo)
            best = min(best, due - now)
        return best

    def prefill_budget(self, decodes: list[Request], prefill_start: int) -> int:
        """Prefill tokens this iteration, given the decodes already scheduled and the
        computed length of the first prefill in line (its attention context)."""
        upper = self.upper - len(decodes)
        if upper <= 0:
            return 0
        if self.calibrating:
            return min(upper, next(self._explore))
        self._iterations += 1
        if not decodes:
            return upper
        self._with_decodes += 1
        slack = self.slack(decodes, self.clock())
        positions = [r.num_computed_tokens for r in decodes]
        base_ctx = sum(positions) + len(positions)
        model = self.model
        available = slack - model.overhead_s

        def fits(n: int) -> bool:
            shape = IterationShape(
                num_prefill_tokens=n,
                num_prefill_seqs=1,
                prefill_attention_pairs=chunk_attention_pairs(prefill_start, n),
                num_decode_seqs=len(decodes),
                decode_context_tokens=base_ctx,
                num_sampled=len(decodes) + 1,
            )
            return model.predict(shape) * model.margin <= available

        # candidates: TILE, 2 TILE, ..., and `upper` itself; bisection for the largest fit
        top = upper // TILE_TOKENS
        if fits(upper):
            chunk = upper
        else:
            lo, hi = 0, top  # fits(lo * TILE) known true for lo = 0 (no prefill)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mid * TILE_TOKENS < upper and fits(mid * TILE_TOKENS):
                    lo = mid
                else:
                    hi = mid - 1
            chunk = lo * TILE_TOKENS
            self._limited += 1
        if chunk < MIN_CHUNK_TOKENS:
            chunk = min(MIN_CHUNK_TOKENS, upper)
            self._min_chunk += 1
        self._chunk_sum += chunk
        return chunk

    def observe_iteration(
        self, shape: IterationShape, start: float, end: float, *, calibrated: bool
    ) -> None:
        """Feeds one finished iteration (plan built at `start`, result in at `end`) to the
        latency model; `calibrated`: the calibration requests are all done (then the
        calibration ends with a fit)."""
        last, self._last_end = self._last_end, end
        # a gap longer than the target is idle time (no work), not per-iteration overhead
        gap = start - last if last is not None and start - last < self.tbt_slo else None
        self.model.observe(shape, end - start, gap)
        if self.calibrating and calibrated:
            self.calibrating = False
            self.model.refit()

    def stats_fields(self) -> dict[str, float | int | bool]:
        """The `SchedulerStats` fields of the budget (see their docstring)."""
        err = self.model.error()
        b = self.stats()
        return {
            "tbt_slo": self.tbt_slo,
            "calibrating": self.calibrating,
            "latency_model_samples": err.num_samples,
            "latency_model_mape": err.mape,
            "latency_model_p95_error": err.p95_abs_pct,
            "latency_model_margin": self.model.margin,
            "budget_mean_chunk": b.mean_chunk,
            "budget_limited_iterations": b.num_limited,
            "budget_min_chunk_iterations": b.num_min_chunk,
        }

    def stats(self) -> BudgetStats:
        return BudgetStats(
            num_iterations=self._iterations,
            num_limited=self._limited,
            num_min_chunk=self._min_chunk,
            mean_chunk=self._chunk_sum / self._with_decodes if self._with_decodes else 0.0,
        )


def build_adaptive_budget(
    config: SchedulerConfig, clock: Callable[[], float]
) -> AdaptiveBudget | None:
    """The budget of a scheduler config (None without a TBT target). A latency_profile
    seeds the model and skips the calibration; a bad profile is a ValueError naming it."""
    if not config.tbt_slo:
        return None
    from sarazmq.scheduler.online import OnlineLatencyModel

    prior = None
    if config.latency_profile:
        try:
            prior, _ = profile_model(config.latency_profile)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"latency_profile {config.latency_profile!r}: {e}") from None
    return AdaptiveBudget(
        config.tbt_slo,
        config.chunk_size,
        OnlineLatencyModel(prior),
        clock,
        calibrating=prior is None,
    )


def calibration_requests(
    upper: int, max_tokens: int, vocab_hint: int = 100
) -> list[tuple[str, list[int], SamplingParams]]:
    """(request id, prompt, params) of the calibration requests: distinct prompts (no
    prefix-cache hits) of ids below `vocab_hint`. Empty when the context or the pool is
    too small to calibrate (the budget then starts from its upper bound and learns from
    live iterations)."""
    n = AdaptiveBudget.calibration_prompt_len(upper, max_tokens)
    if n < MIN_CHUNK_TOKENS:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=CALIBRATION_OUTPUT_TOKENS, ignore_eos=True)
    return [
        (
            f"{CALIBRATION_ID_PREFIX}{i}",
            [1 + (i * 7919 + j * 31) % vocab_hint for j in range(n)],
            params,
        )
        for i in range(CALIBRATION_REQUESTS)
    ]
