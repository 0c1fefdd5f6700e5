"""scripts/bench_engine.py --int8's report (scripts/engine_bench/report.py): the integer
path's limit of a batch and the goal lines of issue 38, on known costs and times."""

from __future__ import annotations

from pathlib import Path

import pytest

from sarazmq.perf.cost import ModelCost as IterationCost

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a module
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from engine_bench import report as module

    return module


def _cost(report):  # noqa: ANN001, ANN202 - modules from scripts/
    from engine_bench.cost import ModelCost

    return ModelCost(base=IterationCost.from_architecture("smollm2-135m", elem=4))


def test_int8_limit_splits_matmuls_from_attention(report) -> None:  # noqa: ANN001
    cost = _cost(report)
    peak, bw, int8_peak = 100e9, 1e15, 300e9  # bandwidth out of the way
    q, k = [512], [1024]
    total = cost.flops(q, k, 0)
    linear = cost.base.linear_flops(512)
    assert 0 < linear < total
    want = linear / int8_peak + (total - linear) / peak
    assert report.int8_limit_s(cost, q, k, 0, peak, bw, int8_peak) == pytest.approx(want)
    # with no int8 advantage it is the float roofline's compute term
    assert report.int8_limit_s(cost, q, k, 0, peak, bw, peak) == pytest.approx(total / peak)
    # bytes bound where the bandwidth is tiny
    slow = report.int8_limit_s(cost, [1], [512], 1, peak, 1e6, int8_peak)
    assert slow == pytest.approx(cost.bytes([512]) / 1e6)


def test_goals_follow_the_measured_ratios(report, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    cost = _cost(report)
    peak, bw, int8_peak = 100e9, 1e15, 300e9
    keys = ("prefill_chunked", "prefill_single", "decode_16", "decode_64", "hybrid", "chunk")
    ours = dict.fromkeys(keys, 1.0)
    chunk_lim = sum(
        report.int8_limit_s(cost, [512], [s + 512], 0, peak, bw, int8_peak)
        for s in range(0, 2048, 512)
    )
    # prefill exactly at the int8 limit (and faster than 1.5x float32), decode 16 1.3x,
    # decode 64 slower than float32
    ours["prefill_chunked"] = 2 * chunk_lim
    int8 = {**ours, "prefill_chunked": chunk_lim, "decode_16": 1 / 1.3, "decode_64": 1.25}
    goals = report.print_int8_report(ours, int8, cost, peak, bw, int8_peak)
    assert [ok for _, ok in goals] == [True, True, True, False]
    out = capsys.readouterr().out
    assert "| 2.00x |" in out and "| 1.00 |" in out  # prefill's speedup and of limit
    assert "| decode step, 64 running x 512 ctx | 1000.00 ms | 1250.00 ms | 0.80x |" in out
    assert "decode at 64 running >= 1.3x float32: NOT met" in out
    # a prefill below 0.8 of the limit misses that goal only
    slower = {**int8, "prefill_chunked": chunk_lim / 0.79}
    goals = report.print_int8_report(ours, slower, cost, peak, bw, int8_peak)
    assert [ok for _, ok in goals] == [True, False, True, False]  # 2 * 0.79 >= 1.5


def test_the_int8_kv_cache_table_gives_each_path_against_float32(
    report,  # noqa: ANN001
    capsys: pytest.CaptureFixture[str],
) -> None:
    keys = ("prefill_chunked", "prefill_single", "decode_16", "decode_64", "hybrid", "chunk")
    ours = dict.fromkeys(keys, 1.0)
    int8 = {**ours, "decode_16": 0.8, "prefill_chunked": 0.5}
    kv_int8 = {**int8, "decode_16": 0.5, "hybrid": 2.0}
    report.print_kv_int8_report(ours, int8, kv_int8)
    out = capsys.readouterr().out
    assert (
        "| decode step, 16 running x 512 ctx | 1000.00 ms | 800.00 ms | 500.00 ms | 1.25x | 2.00x |"
        in out
    )
    assert (
        "| prefill 2048 tok, 512-token chunks | 2,048 tok/s | 4,096 tok/s | 4,096 tok/s | 2.00x | 2.00x |"
        in out
    )
    assert (
        "| hybrid: 256-tok chunk + 32 decodes | 1000.00 ms | 1000.00 ms | 2000.00 ms | 1.00x | 0.50x |"
        in out
    )


def test_the_bytes_of_a_decode_count_the_cache_as_it_is_held(report) -> None:  # noqa: ANN001
    from engine_bench.cost import ModelCost

    base = IterationCost.from_architecture("smollm2-135m", elem=4)
    # float32 rows of D = 64 against int8 rows (64 bytes + a 4-byte scale), 3 KV heads
    int8_token = 2 * 3 * 68 * base.num_layers
    own = ModelCost(base=base)
    int8 = ModelCost(base=base, kv_token_bytes=float(int8_token))
    assert own.bytes([512]) - base.weight_bytes == base.kv_bytes_per_token * 512
    assert int8.bytes([512]) - base.weight_bytes == int8_token * 512
    assert base.kv_bytes_per_token / int8_token == pytest.approx(256 / 68)


def test_the_kv_cache_bench_refuses_bad_arguments_and_reports_a_failed_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_kv_int8

    for bad in (["--pairs", "0"], ["--output", "-1"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit) as stop:
            bench_kv_int8.main(bad)
        assert stop.value.code == 2
    assert "--pairs=0 must be >= 1" in capsys.readouterr().err

    # a run whose process fails ends the bench with that failure's message (one line)
    class Failed:
        returncode, stdout, stderr = 1, "", "Traceback ...\nValueError: no model here"

    monkeypatch.setattr(bench_kv_int8.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(SystemExit, match="the auto run failed: .*no model here"):
        bench_kv_int8.main(["--pairs", "1"])
