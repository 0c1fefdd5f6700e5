"""Prefill/decode disaggregation in simulated time (sarazmq.sim.disagg), the scheduler's
side of it (`add_prefilled_request`), and `simulate --disaggregate` with goodput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from scheduler_harness import sim_config
from test_router import _conversations
from test_simulator import Linear, _requests

from sarazmq.cli import main
from sarazmq.config import SchedulerConfig
from sarazmq.protocol.worker import StepResult
from sarazmq.replay.metrics import request_metrics, slo_goodput
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.sim.disagg import DisaggSpec, simulate_disaggregated
from sarazmq.validation import InvalidRequestError

KV_BYTES = 1000  # per token


def _configs(decode_blocks: int = 2000, **kw: object):
    prefill = sim_config(num_blocks=2000, max_model_len=4096, chunk_size=256, **kw)
    decode = sim_config(num_blocks=decode_blocks, max_model_len=4096, chunk_size=256)
    return prefill, decode


def test_the_decode_side_admits_a_prefilled_request_as_computed() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=64, max_model_len=256), 4, 64, 256, ())
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_prefilled_request(
        "r", list(range(10, 30)), params, first_token=7, first_token_time=1.5,
        first_scheduled_time=1.0, arrival_time=0.5,
    )  # fmt: skip
    plan = sched.schedule()
    assert plan is not None
    (new,) = plan.new_seqs
    # the prompt's 20 tokens are there: one token to compute (the first output's)
    assert [(s.num_tokens, s.sample) for s in plan.scheduled] == [(1, True)]
    assert new.token_ids == [*range(10, 30), 7] and new.num_cached_tokens == 20
    (delta,) = sched.process_result(StepResult(step=plan.step, seq_ids=[0], token_ids=[9]))
    assert delta.new_token_ids == [9] and delta.first_scheduled_time == 1.0
    req = sched.get_request("r")
    assert req is not None and req.output_token_ids == [7, 9] and req.token_times[0] == 1.5
    with pytest.raises(InvalidRequestError, match="nothing is left to decode"):
        sched.add_prefilled_request(
            "done", [1, 2, 3], SamplingParams(max_tokens=1), first_token=5,
            first_token_time=0.0, first_scheduled_time=0.0, arrival_time=0.0,
        )  # fmt: skip
    assert sched.get_request("done") is None and len(sched.waiting) == 0


def test_every_request_completes_with_its_first_token_from_the_prefill_side() -> None:
    reqs = _requests([(0.01 * i, 100 + 37 * i, 5 + i % 7) for i in range(40)])
    prefill, decode = _configs()
    out = simulate_disaggregated(
        reqs, prefill, decode, Linear(), Linear(), DisaggSpec(2, 1, 1e9, KV_BYTES)
    )
    assert [r.request_id for r in out.records] == [r.request_id for r in reqs]
    for rec, wr in zip(out.records, reqs):
        assert rec.ok and rec.num_output_tokens == wr.output_tokens
        assert len(rec.token_times_s) == wr.output_tokens
        assert rec.arrival_s == wr.arrival_s and rec.token_times_s == sorted(rec.token_times_s)
    assert out.transfers["count"] == 40
    mean_prompt = sum(r.input_tokens for r in reqs) / len(reqs)
    assert out.transfers["bytes_mean"] == pytest.approx(mean_prompt * KV_BYTES)
    # the prefill instances made one token per request; the decode one the rest
    assert sum(r.requests for r in out.replicas[:2]) == 40 and out.replicas[2].requests == 40


def test_a_slow_link_delays_the_second_token_not_the_first() -> None:
    reqs = _requests([(0.05 * i, 800, 6) for i in range(20)])
    prefill, decode = _configs()
    fast = simulate_disaggregated(reqs, prefill, decode, Linear(), Linear(),
                                  DisaggSpec(1, 1, 1e12, KV_BYTES))  # fmt: skip
    slow = simulate_disaggregated(reqs, prefill, decode, Linear(), Linear(),
                                  DisaggSpec(1, 1, 4e6, KV_BYTES))  # 0.2 s per prompt  # fmt: skip

    def first_gaps(out):
        return [r.token_times_s[1] - r.token_times_s[0] for r in out.records]

    assert [r.token_times_s[0] for r in fast.records] == [r.token_times_s[0] for r in slow.records]
    assert min(first_gaps(slow)) >= 0.2 > max(first_gaps(fast))
    assert slow.transfers["seconds_mean"] >= 0.2


def test_decode_side_preemption_recomputes_the_prompt_there() -> None:
    # a small decode pool: growing decodes preempt each other and recompute their
    # prompts on the decode instance (the KV is not asked for again)
    reqs = _requests([(0.001 * i, 200, 64) for i in range(8)])
    prefill, decode = _configs(decode_blocks=60)
    out = simulate_disaggregated(
        reqs, prefill, decode, Linear(), Linear(), DisaggSpec(1, 1, 1e9, KV_BYTES)
    )
    assert all(r.ok and r.num_output_tokens == 64 for r in out.records)
    assert sum(r.num_preemptions for r in out.records) > 0


def test_prefix_caching_keeps_working_on_the_prefill_side() -> None:
    reqs = _conversations(6, 3, 0.01)  # later turns extend earlier prompts
    prefill, decode = _configs(enable_prefix_caching=True)
    out = simulate_disaggregated(
        reqs, prefill, decode, Linear(), Linear(), DisaggSpec(1, 1, 1e9, KV_BYTES),
        exact_prompts=True,
    )  # fmt: skip
    assert all(r.ok for r in out.records)
    assert out.replicas[0].prefix_cache_hits > 0


def test_disagg_spec_and_goodput_checks() -> None:
    with pytest.raises(ValueError, match=">= 1 prefill and >= 1 decode"):
        DisaggSpec(0, 1, 1e9, KV_BYTES)
    with pytest.raises(ValueError, match="kv_link_bytes_s"):
        DisaggSpec(1, 1, 0.0, KV_BYTES)
    reqs = _requests([(0.1 * i, 50, 4) for i in range(5)])
    prefill, decode = _configs()
    out = simulate_disaggregated(reqs, prefill, decode, Linear(), Linear(),
                                 DisaggSpec(1, 1, 1e9, KV_BYTES))  # fmt: skip
    g = slo_goodput(out.records, 10.0, 10.0, 2)
    assert g["num_good"] == 5 and g["attainment"] == 1.0
    assert g["per_gpu"] == pytest.approx(g["requests_per_s"] / 2)
    tight = slo_goodput(out.records, 0.0, 10.0, 2)
    assert tight["num_good"] == 0
    assert all(request_metrics(r).ttft_s > 0 for r in out.records)


def test_cli_simulate_disaggregated(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["simulate", "fixed", "--input-tokens", "512", "--output-tokens", "16",
            "--max-requests", "40", "--qps", "4", "--gpu", "a100", "--arch", "mistral-7b",
            "--disaggregate", "1:2", "--kv-link-gbs", "10", "--slo-ttft", "1",
            "--slo-tpot", "0.1", "--output-dir", str(out), "--no-plots"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "1 prefill + 2 decode instances" in r.output and "per GPU (3 GPUs)" in r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["num_completed"] == 40 and s["disaggregated"]["decode"] == 2
    # a 512-token prompt of Mistral-7B's KV (128 KiB per token) at 10 GB/s
    assert s["disaggregated"]["kv_transfers"]["bytes_mean"] == 512 * 131072
    assert s["slo_goodput"]["num_gpus"] == 3
    split = args.index("--disaggregate") + 1
    bad = CliRunner().invoke(main, [*args[:split], "2-1", *args[split + 1 :]])
    assert bad.exit_code != 0 and "P:D" in bad.output
    noarch = ["simulate", "fixed", "--input-tokens", "8", "--output-tokens", "4",
              "--max-requests", "2", "--qps", "1", "--profile", str(tmp_path / "none.json"),
              "--disaggregate", "1:1"]  # fmt: skip
    assert CliRunner().invoke(main, noarch).exit_code != 0


def test_commands_that_simulate_one_engine_refuse_several(tmp_path: Path) -> None:
    """`capacity --simulate` and `sweep --simulate` model one co-located engine: replicas
    or prefill/decode instances are a one-line error naming the flag, not a run of
    something else; the simulator's entry point refuses such a config too."""
    sim = ["--simulate", "--gpu", "a100", "--arch", "mistral-7b"]
    capacity = ["capacity", "fixed", *sim, "--input-tokens", "64", "--output-tokens", "8",
                "--max-requests", "4", "--slo-tbt", "0.1", "--slo-sched-delay", "1",
                "--output-dir", str(tmp_path / "c")]  # fmt: skip
    sweep = ["sweep", *sim, "--quick", "--output-dir", str(tmp_path / "s")]
    for cmd in (capacity, sweep):
        for extra, flag in ((["--disaggregate"], "--disaggregate"), (["--dp", "2"], "--dp")):
            r = CliRunner().invoke(main, [*cmd, *extra])
            assert r.exit_code == 2 and f"Invalid value for {flag}" in r.output, r.output
    from sarazmq.sim import simulate_workload

    config = sim_config(num_blocks=100, max_model_len=256, disaggregate=True)
    with pytest.raises(ValueError, match="simulate_disaggregated"):
        simulate_workload([], config, Linear())
