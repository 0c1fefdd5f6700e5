"""The simulator (`sarazmq.sim`): the real scheduler in simulated time.

Invariants on random workloads (every policy, with preemptions), metrics on
hand-computed cases, prompts and the prefix cache, the TBT budget in simulated time. The
comparison with the real engine and the commands are in test_simulate_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_harness import sim_config

from sarazmq.replay.metrics import summarize
from sarazmq.replay.workload import PromptSource, WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.scheduler.shape import IterationShape
from sarazmq.sim import ReplayLatency, build_sim_scheduler, simulate, simulate_workload

MOONCAKE = Path(__file__).parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


class Constant:
    """Every iteration takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, shape: IterationShape) -> float:
        return self.seconds


class Linear:
    """A latency that depends on the shape (so policies differ in time, not only in order)."""

    def predict(self, shape: IterationShape) -> float:
        return 0.004 + 2e-5 * shape.num_prefill_tokens + 1e-6 * shape.decode_context_tokens


def _requests(lengths: list[tuple[float, int, int]]) -> list[WorkloadRequest]:
    """Hand-made requests: (arrival_s, prompt tokens, output tokens)."""
    return [
        WorkloadRequest(f"req-{i}", a, n_in, n_out, i, n_in, n_out)
        for i, (a, n_in, n_out) in enumerate(lengths)
    ]


def _sched(policy: str = "sarathi", **kw):
    geometry = {"block_size": 16, "num_blocks": 512, "max_model_len": 4096, "seed": 0}
    geometry.update({k: kw.pop(k) for k in list(kw) if k in geometry})
    return build_sim_scheduler(sim_config(scheduler=policy, **geometry, **kw))


# ---------------------------------------------------------------------------- hand cases


def test_one_request_exact_times() -> None:
    """3 prompt tokens, 4 outputs, 10 ms iterations: one prefill iteration then three
    decodes; tokens at 10, 20, 30, 40 ms."""
    out = simulate(_requests([(0.0, 3, 4)]), _sched(chunk_size=256), Constant(0.01))
    (rec,) = out.records
    assert rec.ok and rec.finish_reason == "length" and rec.num_output_tokens == 4
    assert rec.token_times_s == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert rec.first_scheduled_s == 0.0 and rec.arrival_s == 0.0
    assert out.num_iterations == 4 and out.sim_time_s == pytest.approx(0.04)
    assert [(it.num_prefill_tokens, it.num_decode_tokens) for it in out.iterations] == [
        (3, 0),
        (0, 1),
        (0, 1),
        (0, 1),
    ]
    assert [it.forward_s for it in out.iterations] == pytest.approx([0.01] * 4)
    s = summarize(out.records, out.iterations)
    assert s["ttft_s"]["p50"] == pytest.approx(0.01)
    assert s["tbt_s"]["count"] == 3 and s["tbt_s"]["max"] == pytest.approx(0.01)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01)
    assert s["e2e_s"]["p50"] == pytest.approx(0.04)
    assert s["iterations"]["busy_fraction"] == pytest.approx(1.0)


def test_arrival_mid_iteration_and_idle_gap() -> None:
    """A request arriving during an iteration joins the next one (with its true arrival
    time); one arriving after everything finished starts the clock again at its arrival."""
    reqs = _requests([(0.0, 3, 3), (0.005, 4, 2), (1.0, 2, 2)])
    out = simulate(reqs, _sched(chunk_size=256), Constant(0.01), overhead_s=0.0)
    a, b, c = out.records
    assert a.token_times_s == pytest.approx([0.01, 0.02, 0.03])
    # b waits for iteration 2 (starts at 10 ms): prefill with a's decode
    assert b.arrival_s == 0.005 and b.first_scheduled_s == pytest.approx(0.01)
    assert b.token_times_s == pytest.approx([0.02, 0.03])
    assert out.iterations[1].num_prefill_tokens == 4 and out.iterations[1].num_decode_tokens == 1
    # idle until 1.0: c is scheduled at its arrival, no waiting
    assert c.first_scheduled_s == 1.0 and c.token_times_s == pytest.approx([1.01, 1.02])
    s = summarize(out.records, out.iterations)
    assert s["ttft_s"]["max"] == pytest.approx(0.015)
    assert s["scheduling_delay_s"]["max"] == pytest.approx(0.005)
    # 5 iterations of 10 ms: 3 for a and b, 2 for c
    assert out.num_iterations == 5 and s["iterations"]["busy_s"] == pytest.approx(0.05)


def test_overhead_is_added_to_every_iteration() -> None:
    out = simulate(_requests([(0.0, 3, 2)]), _sched(), Constant(0.01), overhead_s=0.005)
    assert out.records[0].token_times_s == pytest.approx([0.015, 0.03])


def test_refused_request_is_an_error_record() -> None:
    reqs = _requests([(0.0, 8, 2), (0.0, 5000, 2), (0.1, 8, 2)])
    out = simulate(reqs, _sched(max_model_len=1024), Constant(0.01))
    assert [r.ok for r in out.records] == [True, False, True]
    assert "InvalidRequestError" in out.records[1].error and "5000" in out.records[1].error
    assert summarize(out.records, out.iterations)["num_errors"] == 1


def test_replay_latency_runs_out_loudly() -> None:
    lat = ReplayLatency([0.01, 0.02])
    assert lat.predict(IterationShape()) == 0.01 and lat.num_used == 1
    lat.predict(IterationShape())
    with pytest.raises(IndexError, match="only 2 were given"):
        lat.predict(IterationShape())
    with pytest.raises(ValueError, match=">= 0"):
        ReplayLatency([-1.0])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="sorted"):
        simulate(_requests([(1.0, 3, 2), (0.0, 3, 2)]), _sched(), Constant(0.01))
    with pytest.raises(ValueError, match="overhead_s"):
        simulate(_requests([(0.0, 3, 2)]), _sched(), Constant(0.01), overhead_s=-1)
    with pytest.raises(ValueError, match="num_blocks"):
        _sched(num_blocks=0)
    with pytest.raises(ValueError, match="unknown scheduler policy"):
        _sched("fifo")


# ---------------------------------------------------------------------------- invariants


@pytest.mark.parametrize(
    "policy", ["sarathi", "vllm", "orca", "fastertransformer", "simple_chunking"]
)
@pytest.mark.parametrize("arrivals", ["poisson", "all_at_once"])
def test_invariants(policy: str, arrivals: str) -> None:
    """Every request finishes with its output length, tokens are conserved, times are
    ordered, and with all-at-once arrivals (the server never idles) the iterations tile
    the simulated time exactly."""
    spec = WorkloadSpec(
        vocab_size=1000,
        lengths="uniform",
        input_range=(8, 300),
        output_range=(1, 60),
        max_requests=120,
        arrivals=arrivals,
        qps=40.0 if arrivals == "poisson" else None,
        seed=3,
    )
    reqs = build_workload(spec)
    # a small pool: preemptions happen
    sched = _sched(policy, chunk_size=64, max_num_seqs=16, num_blocks=40, max_model_len=512)
    out = simulate(reqs, sched, Linear())
    assert len(out.records) == len(reqs)
    for r, w in zip(out.records, reqs, strict=True):
        assert r.ok and r.request_id == w.request_id and r.finish_reason == "length"
        assert r.num_output_tokens == w.output_tokens == len(r.token_times_s)
        assert r.num_prompt_tokens == w.input_tokens and r.arrival_s == w.arrival_s
        assert r.first_scheduled_s is not None and r.first_scheduled_s >= r.arrival_s
        assert r.token_times_s[0] > r.first_scheduled_s
        assert all(b >= a for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False))
    s = summarize(out.records, out.iterations)
    assert s["num_completed"] == len(reqs) and s["ttft_s"]["count"] == len(reqs)
    assert s["ttft_s"]["p50"] >= 0
    its = out.iterations
    assert sum(it.num_sampled for it in its) == sum(w.output_tokens for w in reqs)
    assert [it.step for it in its] == list(range(1, len(its) + 1))
    assert all(b.start_s >= a.end_s for a, b in zip(its, its[1:], strict=False))
    assert all(it.forward_s == pytest.approx(it.duration_s) for it in its)
    assert out.num_iterations == len(its) and out.sim_time_s == its[-1].end_s
    if arrivals == "all_at_once":
        assert sum(it.duration_s for it in its) == pytest.approx(out.sim_time_s)
        assert all(b.start_s == a.end_s for a, b in zip(its, its[1:], strict=False))
    if policy in ("sarathi", "vllm", "orca"):
        assert s["total_preemptions"] > 0  # the invariants held through preemptions


def test_tbt_slo_budget_in_simulated_time() -> None:
    """Under a TBT target the real adaptive budget (calibrated in simulated time, as the
    engine calibrates) keeps P99 TBT near the target that a fixed big chunk misses."""
    spec = WorkloadSpec(
        vocab_size=1000,
        lengths="uniform",
        input_range=(300, 3000),
        output_range=(20, 100),
        max_requests=80,
        qps=4.0,
        seed=2,
    )
    reqs = build_workload(spec)
    geometry = {"block_size": 16, "num_blocks": 4000, "max_model_len": 4096, "seed": 0}
    tbt = {}
    for slo in (0.0, 0.02):
        kw = {"scheduler": "sarathi", "chunk_size": 2048, "tbt_slo": slo}
        out = simulate_workload(reqs, sim_config(**kw, **geometry), Linear())
        s = summarize(out.records, out.iterations)
        assert s["num_completed"] == len(reqs) and s["num_requests"] == len(reqs)
        tbt[slo] = s["tbt_s"]["p99"]
    assert tbt[0.0] > 0.03 and tbt[0.02] <= 0.02 * 1.1
    from sarazmq.config import SchedulerConfig
    from sarazmq.scheduler.scheduler import Scheduler

    plain = Scheduler(SchedulerConfig(tbt_slo=0.02, max_model_len=512), 16, 64, 512, ())
    with pytest.raises(ValueError, match="SimClock"):
        simulate(_requests([(0.0, 3, 2)]), plain, Constant(0.01))


def test_stand_in_prompts_never_share_blocks() -> None:
    """With prefix caching on, stand-in prompts (no trace hash ids) behave as random
    prompts: no cache hits, even though their bodies are one shared list."""
    reqs = _requests([(0.01 * i, 100, 2) for i in range(30)])
    on = simulate(reqs, _sched(enable_prefix_caching=True), Constant(0.01))
    assert summarize(on.records, on.iterations)["prefix_cache"]["hits"] == 0
    # exact prompts from one PromptSource row: the same ids, so later ones hit
    source = PromptSource(WorkloadSpec(vocab_size=1000, max_requests=1, qps=1.0))
    same = [
        WorkloadRequest(f"s-{i}", 0.05 * i, 100, 2, 0, 100, 2, prompts=source) for i in range(5)
    ]
    hit = simulate(same, _sched(enable_prefix_caching=True), Constant(0.01), exact_prompts=True)
    assert summarize(hit.records, hit.iterations)["prefix_cache"]["hits"] == 4 * 96


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"trace not found at {MOONCAKE}")
def test_prefix_sharing_workload_uses_real_prompts() -> None:
    spec = WorkloadSpec(
        vocab_size=32000,
        trace_path=str(MOONCAKE),
        max_requests=60,
        prefix_sharing=True,
        length_scale=0.05,
        time_scale=0.01,
    )
    reqs = build_workload(spec)
    kw = {"scheduler": "sarathi", "chunk_size": 256, "enable_prefix_caching": True}
    geometry = {"block_size": 16, "num_blocks": 4000, "max_model_len": 8192, "seed": 0}
    out = simulate_workload(reqs, sim_config(**kw, **geometry), Linear())
    assert summarize(out.records, out.iterations)["prefix_cache"]["hits"] > 0
    off_kw = {**kw, "enable_prefix_caching": False}
    off = simulate_workload(reqs, sim_config(**off_kw, **geometry), Linear())
    assert summarize(off.records, off.iterations)["prefix_cache"]["hits"] == 0
