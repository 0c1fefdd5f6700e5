"""The SLO-aware token budget: the rule on synthetic latency models, online refitting,
and the scheduler with a TBT target (calibration, identical decisions apart from size)."""

from __future__ import annotations

import numpy as np
import pytest

from sarazmq.config import SchedulerConfig
from sarazmq.protocol.worker import StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.adaptive import (
    MIN_CHUNK_TOKENS,
    TILE_TOKENS,
    AdaptiveBudget,
)
from sarazmq.scheduler.latency import PiecewiseLinearModel
from sarazmq.scheduler.online import OnlineLatencyModel
from sarazmq.scheduler.request import Request
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.shape import IterationShape


class LinearTokens:
    """t = base + per_token * (prefill tokens + decodes): a model with a known answer."""

    def __init__(self, base: float, per_token: float) -> None:
        self.base, self.per_token = base, per_token

    def predict(self, shape: IterationShape) -> float:
        return self.base + self.per_token * shape.num_tokens


def decode(token_times: list[float], computed: int = 100) -> Request:
    req = Request(
        request_id=f"r{len(token_times)}-{token_times[0]}",
        seq_id=0,
        prompt_token_ids=[1] * computed,
        params=SamplingParams(max_tokens=1000),
        seed=0,
        max_output_tokens=1000,
        arrival_time=0.0,
    )
    req.output_token_ids = [5] * len(token_times)
    req.token_times = list(token_times)
    req.num_computed_tokens = computed + len(token_times) - 1
    return req


def budget(upper: int = 512, slo: float = 0.1, now: float = 10.0, **model: float) -> AdaptiveBudget:
    prior = LinearTokens(model.get("base", 0.01), model.get("per_token", 1e-4))
    return AdaptiveBudget(slo, upper, OnlineLatencyModel(prior), clock=lambda: now)


def test_no_decodes_gets_the_upper_bound() -> None:
    assert budget(upper=300).prefill_budget([], 0) == 300


def test_chunk_is_the_largest_tile_that_fits_the_slack() -> None:
    # one decode whose last token came 40 ms ago under a 100 ms target: 60 ms of slack;
    # 0.01 + 1e-4 * (1 + n) <= 0.06  ->  n <= 499  ->  tile-aligned: 496
    b = budget(upper=2048)
    chunk = b.prefill_budget([decode([9.96])], 0)
    assert chunk == 496 and chunk % TILE_TOKENS == 0
    assert b.stats().num_limited == 1


def test_upper_bound_caps_the_chunk_and_counts_decodes() -> None:
    # plenty of slack: the whole upper bound minus the decodes (a decode counts one)
    b = budget(upper=256, per_token=1e-6)
    assert b.prefill_budget([decode([9.999]), decode([9.999])], 0) == 254
    assert b.stats().num_limited == 0


def test_no_slack_runs_the_minimum_chunk() -> None:
    b = budget()
    assert b.prefill_budget([decode([9.5])], 0) == MIN_CHUNK_TOKENS  # 400 ms late
    assert b.stats().num_min_chunk == 1


def test_slack_is_the_earliest_deadline() -> None:
    b = budget(slo=0.1)
    ahead = decode([9.9, 9.91, 9.92, 9.95])  # due at 9.9 + 4 * 0.1, but the gap: 10.05
    behind = decode([9.5, 9.8])  # token 2 due at 9.5 + 0.2 = 9.7: already 300 ms late
    assert b.slack([ahead], 10.0) == pytest.approx(0.05)
    assert b.slack([behind], 10.0) == pytest.approx(-0.3)
    assert b.slack([ahead, behind], 10.0) == pytest.approx(-0.3)
    assert b.slack([], 10.0) == float("inf")


def test_prediction_margin_and_overhead_shrink_the_chunk() -> None:
    b = budget(upper=2048)
    model = b.model
    model.warmup = 0
    # measured 2x the prediction, every time: the margin follows (1 + P95 of 100 %)
    for _ in range(20):
        model.observe(IterationShape(num_prefill_tokens=100, num_prefill_seqs=1), 2 * 0.02)
    assert model.margin == pytest.approx(2.0)
    # 2 * (0.01 + 1e-4 * (1 + n)) <= 0.06  ->  n <= 199  ->  192
    assert b.prefill_budget([decode([9.96])], 0) == 192


def test_chunk_respects_the_attention_context() -> None:
    """A long-context prefill costs more per token: a model that charges attention pairs
    gives it a smaller chunk than a fresh prompt."""
    m = PiecewiseLinearModel(knee=1, c0=0.005, c_tok=5e-5, c_pairs=1e-8)
    b = AdaptiveBudget(0.1, 2048, OnlineLatencyModel(m), clock=lambda: 10.0)
    fresh = b.prefill_budget([decode([9.96])], 0)
    deep = b.prefill_budget([decode([9.96])], 4000)
    assert 0 < deep < fresh


def test_calibration_cycles_the_candidate_sizes() -> None:
    b = AdaptiveBudget(0.1, 300, OnlineLatencyModel(), clock=lambda: 0.0, calibrating=True)
    sizes = [b.prefill_budget([], 0) for _ in range(8)]
    assert set(sizes) == {32, 64, 128, 256, 300}


# ---------------------------------------------------------------------------- refitting


def test_online_refit_converges_and_drops_outliers() -> None:
    true = PiecewiseLinearModel(knee=64, c0=0.004, c_tok=2e-5, c_ctx=3e-8, c_seq=1e-4)
    rng = np.random.default_rng(0)
    online = OnlineLatencyModel(refit_every=50, warmup=0)
    for i in range(600):
        shape = IterationShape(
            num_prefill_tokens=int(rng.integers(0, 512)),
            num_prefill_seqs=1,
            num_decode_seqs=int(rng.integers(0, 64)),
            decode_context_tokens=int(rng.integers(0, 64 * 1024)),
        )
        t = true.predict(shape) * float(rng.normal(1.0, 0.02))
        if i % 97 == 0:
            t *= 20  # a stalled iteration: must not drag the fit
        online.observe(shape, t, gap_s=0.001)
    assert online.num_refits >= 10
    test = [IterationShape(num_prefill_tokens=n, num_decode_seqs=16) for n in (32, 256, 500)]
    for s in test:
        assert online.predict(s) == pytest.approx(true.predict(s), rel=0.05)
    err = online.error()
    assert err.num_samples > 400 and err.mape < 0.1
    assert 1.0 < online.margin < 1.2  # the 2 % noise, not the outliers' 20x
    assert online.overhead_s == pytest.approx(0.001)


# ---------------------------------------------------------------------------- scheduler


def machine(shape: IterationShape) -> float:
    """The simulated machine: 2 ms + 0.1 ms per token."""
    return 0.002 + 1e-4 * shape.num_tokens


def run(sched: Scheduler, clock: list[float]) -> list[tuple[IterationShape, float]]:
    """Runs to the end on `machine`; returns each iteration's shape and time."""
    out = []
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan is not None
        shape = sched.inflight_shape
        dt = machine(shape)
        clock[0] += dt
        out.append((shape, dt))
        sampled = [s.seq_id for s in plan.scheduled if s.sample]
        sched.process_result(
            StepResult(step=plan.step, seq_ids=sampled, token_ids=[7] * len(sampled))
        )
    return out


def make_scheduler(clock: list[float], **config: object) -> Scheduler:
    cfg = SchedulerConfig(policy="sarathi", chunk_size=256, max_model_len=2048, **config)
    return Scheduler(cfg, 16, 2048, 2048, (0,), clock=lambda: clock[0])


def test_scheduler_calibrates_first_and_hides_calibration_outputs() -> None:
    clock = [0.0]
    sched = make_scheduler(clock, tbt_slo=0.05)
    assert sched.calibrating and sched.has_unfinished()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sched.add_request("user", list(range(10, 600)), params)
    deltas = []
    while sched.has_unfinished():
        plan = sched.schedule()
        clock[0] += machine(sched.inflight_shape)
        sampled = [s.seq_id for s in plan.scheduled if s.sample]
        deltas += sched.process_result(
            StepResult(step=plan.step, seq_ids=sampled, token_ids=[7] * len(sampled))
        )
    assert {d.request_id for d in deltas} == {"user"}
    assert sum(len(d.new_token_ids) for d in deltas) == 20
    stats = sched.stats()
    assert not stats.calibrating and stats.num_finished == 1
    assert stats.tbt_slo == 0.05 and stats.latency_model_samples > 0
    assert stats.latency_model_mape < 0.05  # a noiseless linear machine: learnt exactly


def test_tbt_target_needs_the_sarathi_policy() -> None:
    with pytest.raises(ValueError, match="tbt_slo needs the sarathi policy"):
        SchedulerConfig(policy="vllm", tbt_slo=0.1)
    with pytest.raises(ValueError, match="tbt_slo"):
        SchedulerConfig(tbt_slo=-1.0)
    with pytest.raises(ValueError, match="latency_profile is only used with tbt_slo"):
        SchedulerConfig(latency_profile="p.json")


def test_bad_latency_profile_is_named(tmp_path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="latency_profile"):
        make_scheduler([0.0], tbt_slo=0.05, latency_profile=str(bad))


def test_target_holds_where_the_fixed_chunk_breaks_it() -> None:
    """On a machine where a 256-token iteration takes 27.6 ms, a 20 ms target keeps every
    iteration with decodes running within it (the chunk shrinks as decodes pile up), while
    the fixed 256 chunk breaks it; both serve every token."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def load(sched: Scheduler) -> None:
        for i in range(24):
            sched.add_request(f"r{i}", [i + 1] * (50 + 60 * i), params)

    times = {}
    for name, extra in (("fixed", {}), ("adaptive", {"tbt_slo": 0.02})):
        clock = [0.0]
        sched = make_scheduler(clock, **extra)
        run(sched, clock)  # calibration only (the fixed scheduler has nothing to run)
        load(sched)
        iterations = run(sched, clock)
        assert sum(s.num_sampled for s, _ in iterations) >= 24 * 40
        times[name] = [dt for s, dt in iterations if s.num_decode_seqs]
    assert max(times["fixed"]) > 0.025
    assert max(times["adaptive"]) <= 0.02 * 1.0001
    assert len(times["adaptive"]) > len(times["fixed"])  # smaller chunks: more iterations


def test_metrics_show_the_budget_only_under_a_target() -> None:
    from sarazmq.api.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.observe_stats({"num_running": 1})
    assert b"tbt_slo" not in metrics.render()
    metrics.observe_stats({"tbt_slo": 0.05, "latency_model_mape": 0.07, "budget_mean_chunk": 96})
    text = metrics.render().decode()
    assert 'sarazmq:tbt_slo_seconds{model_name="m"} 0.05' in text
    assert 'sarazmq:latency_model_mape{model_name="m"} 0.07' in text
    assert 'sarazmq:budget_mean_chunk_tokens{model_name="m"} 96.0' in text


def test_first_iterations_of_a_process_are_ignored() -> None:
    online = OnlineLatencyModel(warmup=8, min_samples=8, refit_every=8)
    shape = IterationShape(num_prefill_tokens=64, num_prefill_seqs=1)
    for _ in range(8):
        online.observe(shape, 1.0)  # lazy initialisation: 100x slower
    assert online.num_samples == 0
    for n in (16, 32, 64, 128, 256, 16, 32, 64):
        online.observe(IterationShape(num_prefill_tokens=n, num_prefill_seqs=1), 0.001 + 1e-5 * n)
    assert online.predict(shape) == pytest.approx(0.001 + 1e-5 * 64, rel=0.05)


def test_records_show_the_adaptive_budget_below_the_chunk() -> None:
    """Under a TBT target each record carries the budget the latency model chose: below
    chunk_size once decodes pile up, and never less than the tokens it ran."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    clock = [0.0]
    sched = make_scheduler(clock, tbt_slo=0.02)
    run(sched, clock)
    for i in range(24):
        sched.add_request(f"r{i}", [i + 1] * (50 + 60 * i), params)
    run(sched, clock)
    mixed = [r for r in sched.iteration_records if r.num_decode_tokens and r.num_prefill_tokens]
    assert mixed
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= r.token_budget for r in mixed)
    assert min(r.token_budget for r in mixed) < 256  # the chunk shrank under the target
