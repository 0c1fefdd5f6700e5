"""The iteration latency models: the piecewise-linear fit (known answers), NNLS, the error
report, FLOP/byte counts, the Vidur-table and roofline GPU models, and `sarazmq profile`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sarazmq.cli import main
from sarazmq.perf.accuracy import prediction_error
from sarazmq.perf.architectures import Architecture, get_architecture
from sarazmq.perf.cost import ModelCost
from sarazmq.perf.gpu import GpuProfileModel, RooflineModel, vidur_mlp_path
from sarazmq.perf.load import load_latency_model
from sarazmq.scheduler.latency import PiecewiseLinearModel
from sarazmq.scheduler.latency_fit import fit_latency_model, nnls, predict_many
from sarazmq.scheduler.shape import IterationShape, shape_of

TRUE = PiecewiseLinearModel(
    knee=64, c0=2e-3, c_tok=1e-4, c_pairs=2e-8, c_ctx=3e-7, c_seq=5e-5, c_sampled=1e-4
)


def _random_shapes(n: int, seed: int = 0) -> list[IterationShape]:
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        pre = [
            (int(rng.integers(0, 1000)), int(rng.integers(1, 512)), bool(rng.integers(0, 2)))
            for _ in range(int(rng.integers(0, 3)))
        ]
        dec = [int(rng.integers(10, 2000)) for _ in range(int(rng.integers(0 if pre else 1, 40)))]
        shapes.append(shape_of(pre, dec))
    return shapes


def test_fit_recovers_known_coefficients_and_knee() -> None:
    shapes = _random_shapes(200)
    seconds = [TRUE.predict(s) for s in shapes]
    fit = fit_latency_model(shapes, seconds)
    assert fit.knee == 64
    np.testing.assert_allclose(fit.coefficients(), TRUE.coefficients(), rtol=1e-6)
    # a knee off the default grid, found among given candidates, under 2 % noise
    true = PiecewiseLinearModel(knee=100, c0=1e-3, c_tok=2e-4, c_ctx=1e-7)
    rng = np.random.default_rng(1)
    noisy = [true.predict(s) * (1 + 0.02 * rng.standard_normal()) for s in shapes]
    fit = fit_latency_model(shapes, noisy, knees=[25, 50, 100, 200, 400])
    assert fit.knee == 100
    assert fit.c_tok == pytest.approx(2e-4, rel=0.05)
    assert prediction_error(fit, shapes, noisy).mape < 3.0


def test_fit_never_gives_a_negative_coefficient() -> None:
    shapes = _random_shapes(100, seed=2)
    # time falling with decode context: least squares would give c_ctx < 0
    seconds = [1e-2 + 1e-4 * s.num_tokens - 1e-9 * s.decode_context_tokens for s in shapes]
    fit = fit_latency_model(shapes, seconds)
    assert fit.c_ctx == 0.0
    assert all(c >= 0 for c in fit.coefficients())
    with pytest.raises(ValueError, match="c_ctx"):
        PiecewiseLinearModel(c_ctx=-1.0)
    with pytest.raises(ValueError, match="shapes but"):
        fit_latency_model(shapes, seconds[:-1])


def test_nnls_satisfies_the_optimality_conditions() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        m, n = int(rng.integers(5, 30)), int(rng.integers(1, 8))
        a, b = rng.normal(size=(m, n)), rng.normal(size=m)
        x = nnls(a, b)
        grad = a.T @ (b - a @ x)
        assert (x >= 0).all()
        assert (grad <= 1e-8).all()  # no direction of descent into x >= 0
        np.testing.assert_allclose(grad[x > 0], 0.0, atol=1e-8)
    # unconstrained: x = (1, -1); constrained: the second pinned at 0
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = nnls(a, np.array([1.0, -1.0, 0.0]))
    np.testing.assert_allclose(x, [0.5, 0.0])


def test_json_round_trip_and_predict_many() -> None:
    back = PiecewiseLinearModel.from_dict(json.loads(json.dumps(TRUE.to_dict())))
    assert back == TRUE
    shapes = [*_random_shapes(20), IterationShape()]
    np.testing.assert_allclose(predict_many(TRUE, shapes), [TRUE.predict(s) for s in shapes])
    assert TRUE.predict(IterationShape()) == 0.0
    # below the knee the linear layers cost as much as at the knee
    one = shape_of([], [99])
    assert TRUE.predict(one) == pytest.approx(2e-3 + 64e-4 + 3e-7 * 100 + 5e-5 + 1e-4)
    with pytest.raises(ValueError, match="kind"):
        PiecewiseLinearModel.from_dict({**TRUE.to_dict(), "kind": "roofline"})
    with pytest.raises(ValueError, match="lacks c_tok"):
        PiecewiseLinearModel.from_dict({k: v for k, v in TRUE.to_dict().items() if k != "c_tok"})


def test_error_report_on_hand_computed_case() -> None:
    model = PiecewiseLinearModel(c0=1.0)  # 1 s for any non-empty iteration
    shapes = [shape_of([], [10])] * 4
    report = prediction_error(model, shapes, [1.0, 2.0, 0.5, 1.25])
    # errors 0, 50, 100, 20 %; signed 0, -50, +100, -20
    assert report.n == 4
    assert report.mape == pytest.approx(42.5)
    assert report.p50_abs_pct_error == pytest.approx(35.0)
    assert report.p95_abs_pct_error == pytest.approx(92.5)
    assert report.max_abs_pct_error == pytest.approx(100.0)
    assert report.bias_pct == pytest.approx(7.5)


def test_model_cost_on_a_tiny_hand_computed_model() -> None:
    arch = Architecture("t", 2, 4, 2, 1, 2, 8, 10)  # q width 4, kv width 2, gated MLP
    cost = ModelCost.from_architecture(arch, elem=2)
    assert (cost.linear_params, cost.head_params) == (2 * (4 * 8 + 4 * 4 + 3 * 4 * 8), 40)
    # a 2-token chunk after 3 computed (9 pairs, samples) and a decode at position 5
    shape = shape_of([(3, 2, True)], [5])
    assert (shape.prefill_attention_pairs, shape.decode_context_tokens) == (9, 6)
    assert cost.flops(shape) == 2 * 288 * 3 + 4 * 4 * 2 * (9 + 6) + 2 * 40 * 2
    # weights once; KV (16 bytes a position) read 3 + 2 + 6, written 3
    assert cost.bytes(shape) == (288 + 40) * 2 + 16 * (11 + 3)


def _vidur_row_seconds(path: Path, tokens: int, layers: int) -> float:
    ops = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj")
    ops += ("post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
    rows = [
        r
        for r in csv.DictReader(path.open())
        if int(r["num_tokens"]) == tokens and r["num_tensor_parallel_workers"] == "1"
    ]
    assert rows
    layer = np.mean([sum(float(r[f"time_stats.{o}.median"]) for o in ops) for r in rows])
    emb = np.mean([float(r["time_stats.emb.median"]) for r in rows])
    return (layers * layer + emb) * 1e-3


def test_gpu_profile_model_reproduces_vidur_rows_and_is_monotone() -> None:
    path = vidur_mlp_path("a100", "llama-2-7b")
    if path is None:
        pytest.skip("no Vidur tables in ../shared/gpu_profiles")
    arch = get_architecture("llama-2-7b")
    model = GpuProfileModel.load("a100", arch)
    for tokens in (1, 256, 2048):
        want = _vidur_row_seconds(path, tokens, arch.num_layers)
        assert model.linear_seconds(tokens) == pytest.approx(want, rel=1e-9)
    # the medians wiggle by a few % between neighbouring rows (GEMM tiles, noise); over
    # coarser steps time grows with the work
    prefill = [model.predict(shape_of([(0, n, True)], [])) for n in range(256, 4097, 256)]
    decode = [model.predict(shape_of([], [1024] * b)) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(b > a for a, b in zip(prefill, prefill[1:]))
    assert all(b > a for a, b in zip(decode, decode[1:]))
    # the decode of a 7B model on an A100 is a few tens of ms, not micro- or whole seconds
    assert 5e-3 < model.predict(shape_of([], [1024] * 32)) < 0.1
    got, info = load_latency_model(None, "a100", "mistral-7b")
    assert isinstance(got, GpuProfileModel) and info["source"] == "vidur"
    assert "Meta-Llama-3-8B" in info["mlp_table"]


def test_roofline_fallback_and_flag_errors() -> None:
    model, info = load_latency_model(None, "a100-80gb", "yi-34b", tp=2)
    assert isinstance(model, RooflineModel) and info["source"] == "roofline"
    assert "no Vidur table" in info["why"]
    small = model.predict(shape_of([], [512] * 8))
    big = model.predict(shape_of([(0, 2048, True)], []))
    assert 0 < small < big
    # the same work on a faster GPU takes less time
    h200, _ = load_latency_model(None, "h200", "yi-34b", tp=2)
    assert h200.predict(shape_of([(0, 2048, True)], [])) < big
    with pytest.raises(ValueError, match="not both"):
        load_latency_model("p.json", "a100", "yi-34b")
    with pytest.raises(ValueError, match="--arch is missing"):
        load_latency_model(None, "a100", None)
    with pytest.raises(ValueError, match="--gpu: unknown GPU 'v100'"):
        load_latency_model(None, "v100", "yi-34b")
    with pytest.raises(ValueError, match="--profile .*cannot read"):
        load_latency_model("/nonexistent/p.json", None, None)


def test_profile_quick_end_to_end_on_a_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_model import _save_hf

    from sarazmq.perf import profile as profile_module

    # every point counts as an outlier: the re-timing path runs for all of them
    monkeypatch.setattr(profile_module, "RETIME_FACTOR", 0.0)
    model_dir = _save_hf(tmp_path, "llama")
    out = tmp_path / "profile.json"
    args = ["profile", "--quick", "--runs", "1", "--threads", "1"]
    res = CliRunner().invoke(main, [*args, "--output", str(out), "--model", str(model_dir)])
    assert res.exit_code == 0, res.output
    assert "held-out error: n=" in res.output
    data = json.loads(out.read_text())
    assert data["kind"] == "measured"
    assert data["machine"]["gemm_flops"] > 0 and data["machine"]["bandwidth_bytes_s"] > 0
    assert data["engine"]["model"] == str(model_dir)
    samples = data["samples"]
    assert len(samples) >= 10 and {s["set"] for s in samples} == {"train", "test"}
    assert all(s["seconds"] > 0 for s in samples)
    assert data["engine"]["retimed"] == len(samples)
    assert data["error"]["test"]["n"] == sum(s["set"] == "test" for s in samples)
    model, info = load_latency_model(str(out), None, None)
    assert isinstance(model, PiecewiseLinearModel) and info["source"] == "profile"
    shape = IterationShape(**{k: samples[0][k] for k in IterationShape.__struct_fields__})
    assert model.predict(shape) > 0
    # --tp is the simulator's GPU option, not a profile's
    with pytest.raises(ValueError, match="--tp"):
        load_latency_model(str(out), None, None, tp=2)
    bad = CliRunner().invoke(main, ["profile", "--output", str(out), "--tp", "2", "--quick"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output


def test_profile_from_runs_fits_real_iterations_and_holds_the_last_out(tmp_path) -> None:
    """`sarazmq profile --from-runs`: fitted on the first runs' iterations.csv (scheduler
    durations), tested on the last; the gap between back-to-back iterations is the
    overhead."""
    from sarazmq.replay.metrics import IterationSample
    from sarazmq.replay.report import write_iterations_csv

    def machine(pt: int, nd: int) -> float:
        return 0.003 + 2e-5 * (pt + nd) + 1e-4 * nd

    rng = np.random.default_rng(1)
    dirs = []
    for run in range(3):
        its, t = [], 0.0
        for step in range(80):
            pt, nd = int(rng.integers(0, 300)), int(rng.integers(0, 20))
            dur = machine(pt, nd)
            its.append(
                IterationSample(
                    step, t, t + dur, pt, nd, nd + 1, num_prefill_seqs=1,
                    num_decode_seqs=nd, num_sampled=nd,
                )
            )  # fmt: skip
            t += dur + 0.0005  # 0.5 ms between iterations
        d = tmp_path / f"run{run}"
        d.mkdir()
        write_iterations_csv(d / "iterations.csv", its, 0.0)
        dirs.append(str(d))
    out = tmp_path / "p.json"
    args = ["profile", "--output", str(out)] + [x for d in dirs for x in ("--from-runs", d)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["kind"] == "replayed" and data["runs"]["test"] == dirs[-1]
    assert data["error"]["test"]["mape"] < 1.0  # percent: the machine is linear
    assert data["overhead_s"] == pytest.approx(0.0005, rel=0.01)
    model, info = load_latency_model(str(out), None, None)
    assert info["overhead_s"] == pytest.approx(0.0005, rel=0.01)
    one = CliRunner().invoke(main, ["profile", "--output", str(out), "--from-runs", dirs[0]])
    assert one.exit_code != 0 and "at least two runs" in one.output
