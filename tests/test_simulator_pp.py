"""Pipeline parallelism in the simulator (`sarazmq.sim.pipeline`, `sarazmq.perf.pipeline`).

A hand-computed two-stage timeline, the invariants of random runs (every request done,
at most pp plans in flight, stages run one micro-batch at a time and in order), the
per-stage split of the GPU models, pp = 1 identical to the plain simulator, sarathi's
smaller bubbles than vllm's at a 70B scale, and `sarazmq simulate --pp`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from scheduler_harness import sim_config

from sarazmq.cli import main
from sarazmq.perf.architectures import get_architecture, get_gpu
from sarazmq.perf.gpu import RooflineModel
from sarazmq.perf.load import load_latency_model
from sarazmq.perf.pipeline import IterationParts, PipelineLatency, split_layers
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.scheduler.shape import IterationShape, shape_of
from sarazmq.sim import build_sim_scheduler, simulate, simulate_workload
from sarazmq.sim.pipeline import StageTimeline


class Layers:
    """All time in the decoder layers: `seconds` per iteration, whatever its shape."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, shape: IterationShape) -> float:
        return self.seconds

    def parts(self, shape: IterationShape) -> IterationParts:
        return IterationParts(layers_s=self.seconds)


class Mixed:
    """Shape-dependent, with a first and a last part (so stages differ)."""

    def predict(self, shape: IterationShape) -> float:
        return self.parts(shape).total_s

    def parts(self, shape: IterationShape) -> IterationParts:
        return IterationParts(
            first_s=0.001,
            layers_s=0.004 + 4e-5 * shape.num_prefill_tokens + 1e-6 * shape.decode_context_tokens,
            last_s=0.0005 + 1e-5 * shape.num_sampled,
        )


def _requests(lengths: list[tuple[float, int, int]]) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"req-{i}", a, n_in, n_out, i, n_in, n_out)
        for i, (a, n_in, n_out) in enumerate(lengths)
    ]


def _random_requests(n: int, seed: int, rate: float) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.randint(20, 1500), rng.randint(1, 120)))
    return _requests(out)


def _sched(policy: str = "sarathi", pp: int = 2, **kw):
    return build_sim_scheduler(
        sim_config(
            scheduler=policy,
            block_size=16,
            num_blocks=4096,
            max_model_len=4096,
            seed=0,
            pipeline_parallel_size=pp,
            **kw,
        )
    )


def _pipe(base, pp: int = 2, num_layers: int = 2) -> PipelineLatency:
    return PipelineLatency(base, pp, num_layers, hidden_size=1, link_latency_s=0.0)


def test_two_stage_timeline_by_hand() -> None:
    """Two requests (3 prompt tokens, 4 outputs), the second 5 ms later; 10 ms per stage,
    no transfer time. Request 0 runs on stage 0 over [0, 10], stage 1 over [10, 20];
    request 1 arrives with a free slot, waits for stage 0 and runs [10, 20], [20, 30];
    from then on the two alternate without a gap: tokens every 20 ms, 10 ms apart."""
    out = simulate(
        _requests([(0.0, 3, 4), (0.005, 3, 4)]), _sched(chunk_size=256), _pipe(Layers(0.02))
    )
    r0, r1 = out.records
    assert r0.token_times_s == pytest.approx([0.02, 0.04, 0.06, 0.08])
    assert r1.token_times_s == pytest.approx([0.03, 0.05, 0.07, 0.09])
    assert r1.first_scheduled_s == pytest.approx(0.005)
    assert out.sim_time_s == pytest.approx(0.09) and out.num_iterations == 8
    assert [t for span in out.stage_spans[1] for t in span] == pytest.approx(
        [0.01, 0.02, 0.02, 0.03]
    )
    p = out.pipeline
    assert p is not None and p.pp == 2 and p.max_inflight == 2
    assert p.stage_busy_s == pytest.approx((0.08, 0.08))
    # idle: stage 1 over [0, 10], stage 0 over [80, 90] of 2 x 90 ms
    assert p.active_s == pytest.approx(0.09)
    assert p.bubble_fraction == pytest.approx(0.02 / 0.18)


def test_one_micro_batch_leaves_half_the_pipeline_idle() -> None:
    """One request: its next step needs its last token, so only one micro-batch is ever in
    flight and each stage idles while the other works: bubble 1/2."""
    out = simulate(_requests([(0.0, 3, 5)]), _sched(chunk_size=256), _pipe(Layers(0.02)))
    assert out.pipeline is not None and out.pipeline.max_inflight == 1
    assert out.pipeline.bubble_fraction == pytest.approx(0.5)
    assert out.records[0].token_times_s == pytest.approx([0.02 * k for k in range(1, 6)])


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "simple_chunking"])
@pytest.mark.parametrize("pp", [2, 3])
def test_random_runs_keep_the_pipeline_invariants(policy: str, pp: int) -> None:
    reqs = _random_requests(120, seed=pp, rate=60.0)
    pipe = PipelineLatency(Mixed(), pp, 12, hidden_size=4096, link_bandwidth=25e9)
    out = simulate(reqs, _sched(policy, pp=pp, chunk_size=256, max_num_seqs=32), pipe)
    assert len(out.records) == len(reqs) and all(r.ok for r in out.records)
    assert all(r.num_output_tokens == w.output_tokens for r, w in zip(out.records, reqs))
    p = out.pipeline
    assert p is not None and p.pp == pp and 0.0 <= p.bubble_fraction <= 1.0
    assert 2 <= p.max_inflight <= pp  # the load keeps several in flight, never more than pp
    assert len(out.stage_spans) == out.num_iterations == p.num_micro_batches
    for s in range(pp):  # a stage runs one micro-batch at a time, in plan order
        spans = [mb[s] for mb in out.stage_spans]
        assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    for mb, it in zip(out.stage_spans, out.iterations):
        assert all(mb[s][1] <= mb[s + 1][0] + 1e-12 for s in range(pp - 1))
        assert it.end_s == pytest.approx(mb[-1][1])  # the result: when the last stage ends
        assert it.start_s <= mb[0][0] + 1e-12


def test_pp1_is_the_plain_simulator() -> None:
    """A one-stage PipelineLatency gives exactly the plain model's run."""
    reqs = _random_requests(60, seed=3, rate=30.0)
    base = Mixed()
    plain = simulate(reqs, _sched(pp=1, chunk_size=128), base)
    one = simulate(reqs, _sched(pp=1, chunk_size=128), PipelineLatency(base, 1, 12, 4096))
    assert plain.records == one.records and plain.iterations == one.iterations
    assert plain.sim_time_s == one.sim_time_s
    assert plain.pipeline is not None and plain.pipeline.bubble_fraction == 0.0
    model, info = load_latency_model(None, "a100", "llama-2-70b", tp=4, pp=1)
    assert not isinstance(model, PipelineLatency) and "pipeline" not in info


def test_stage_time_is_half_the_model_at_pp2() -> None:
    """Llama-2-70B, TP4 on A100s, roofline: each of two stages takes about half the
    iteration (40 layers each; the CPU work and LM head fall on the ends)."""
    arch = get_architecture("llama-2-70b")
    base = RooflineModel(get_gpu("a100"), arch, tp=4)
    pipe = PipelineLatency(base, 2, arch.num_layers, arch.hidden_size, link_bandwidth=25e9)
    for shape in (
        shape_of([(0, 512, True)], []),
        shape_of([(1024, 256, False)], range(500, 564)),
        shape_of([], range(1000, 1128)),
    ):
        whole = base.predict(shape)
        stages = pipe.stage_times(shape)
        assert len(stages) == 2 and sum(stages) == pytest.approx(whole, rel=1e-9)
        assert base.parts(shape).total_s == pytest.approx(whole, rel=1e-9)
        for t in stages:
            assert t == pytest.approx(whole / 2, rel=0.15)
        nbytes = shape.num_tokens * arch.hidden_size * 2
        assert pipe.transfer_s(shape) == pytest.approx(pipe.link_latency_s + nbytes / 25e9)
        assert pipe.predict(shape) == pytest.approx(whole + pipe.transfer_s(shape))


def test_layer_split_and_bad_settings() -> None:
    assert split_layers(80, 2) == (40, 40) and split_layers(30, 4) == (8, 8, 7, 7)
    with pytest.raises(ValueError, match="cannot be split"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="link_bandwidth"):
        PipelineLatency(Mixed(), 2, 4, 64, link_bandwidth=0.0)
    with pytest.raises(ValueError, match="max_inflight >= 2"):
        simulate(_requests([(0.0, 3, 2)]), _sched(pp=1), _pipe(Layers(0.01)))
    with pytest.raises(ValueError, match="--pp applies"):
        load_latency_model(__file__, None, None, pp=2)
    with pytest.raises(ValueError, match="stage times"):
        StageTimeline(2).run(0.0, [0.1], 0.0)


def test_sarathi_has_smaller_bubbles_than_vllm_at_70b_scale() -> None:
    """Llama-2-70B, TP4 x PP2 on A100s, a mixed load of long prompts and decodes above
    what the pipeline serves: vllm alternates whole-prompt and decode-only micro-batches
    of very different lengths, sarathi's hybrid batches are alike, so its stages wait less
    (the paper's claim)."""
    reqs = _random_requests(160, seed=7, rate=12.0)
    latency, _ = load_latency_model(None, "a100", "llama-2-70b", tp=4, pp=2)
    bubbles = {}
    for policy in ("sarathi", "vllm"):
        config = sim_config(
            scheduler=policy,
            chunk_size=512,
            max_num_seqs=128,
            block_size=16,
            num_blocks=20_000,
            max_model_len=4096,
            seed=0,
            pipeline_parallel_size=2,
        )
        out = simulate_workload(reqs, config, latency)
        assert all(r.ok for r in out.records)
        assert out.pipeline is not None
        bubbles[policy] = out.pipeline.bubble_fraction
    assert bubbles["sarathi"] < 0.6 * bubbles["vllm"], bubbles


def test_cli_simulate_pp(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "fixed",
            "--input-tokens",
            "700",
            "--output-tokens",
            "40",
            "--max-requests",
            "40",
            "--qps",
            "8",
            "--gpu",
            "a100",
            "--arch",
            "llama-2-70b",
            "--tp",
            "4",
            "--pp",
            "2",
            "--pp-link-gbs",
            "50",
            "--chunk-size",
            "512",
            "--output-dir",
            str(out),
            "--no-plots",
            "--no-progress",
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "pipeline: 2 stages  bubble fraction" in result.output
    assert "2 pipeline stages of 40/40 layers, 50 GB/s" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_completed"] == 40
    pipe = summary["pipeline"]
    assert pipe["pp"] == 2 and 0.0 <= pipe["bubble_fraction"] <= 1.0
    assert summary["settings"]["latency_model"]["pipeline"]["link_bandwidth"] == 50e9
    # the pool: each GPU holds half the layers' weights and KV, so it beats TP4 alone
    assert summary["settings"]["engine"]["cache"]["num_blocks"] > 60_000
