"""`sarazmq sweep`: grid bookkeeping, resume, the short/long mix, point metrics on
hand-computed cases, a simulated sweep end to end and one quick real-deployment sweep."""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from scheduler_harness import sim_config

from sarazmq.cli import main
from sarazmq.config import DEFAULT_CHUNK_SIZE
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.scheduler.shape import IterationShape
from sarazmq.sweep.backends import SimSetup, sim_backend
from sarazmq.sweep.grid import SweepGrid, SweepPoint
from sarazmq.sweep.metrics import busy_fraction, point_row, stall_total, utilization
from sarazmq.sweep.mix import (
    DEFAULT_LONG_TRACE,
    DEFAULT_SHORT_TRACE,
    LengthSource,
    MixSpec,
    build_mixed_workload,
)
from sarazmq.sweep.report import best_chunk
from sarazmq.sweep.runner import SweepSettings, capacities, run_sweep
from sarazmq.sweep.store import (
    POINTS_JSONL,
    SweepFileError,
    changed_sessions,
    flag_points,
    read_points,
)

SHORT = LengthSource(input_tokens=32, output_tokens=16)
LONG = LengthSource(input_tokens=400, output_tokens=16)


def _grid(**over: object) -> SweepGrid:
    base: dict[str, object] = dict(
        policies=("sarathi", "vllm"),
        chunks=(32, 256),
        shares=(0.0, 0.5),
        loads=(200.0,),
        load_kind="qps",
        seeds=(0,),
        max_model_len=1024,
    )
    base.update(over)
    return SweepGrid(**base)  # type: ignore[arg-type]


def _mix(n: int = 24, **over: object) -> MixSpec:
    base: dict[str, object] = dict(vocab_size=1000, short=SHORT, long=LONG, num_requests=n)
    base.update(over)
    return MixSpec(**base)  # type: ignore[arg-type]


class LinearLatency:
    """1 ms + 20 us per token + 10 ns per attention pair / context token."""

    def predict(self, shape: IterationShape) -> float:
        return (
            1e-3
            + 2e-5 * shape.num_tokens
            + 1e-8 * (shape.prefill_attention_pairs + shape.decode_context_tokens)
        )


class TokenCost:
    """1 MFLOP and 1 kB per token through the linear layers."""

    def flops(self, shape: IterationShape) -> float:
        return 1e6 * shape.num_tokens

    def bytes(self, shape: IterationShape) -> float:
        return 1e3 * shape.num_tokens


def _sim(**over: object):
    engine: dict[str, object] = dict(max_num_seqs=32, block_size=16)
    engine.update({k: v for k, v in over.items() if k != "latency"})
    config = sim_config(num_blocks=2048, max_model_len=1024, **engine)
    return sim_backend(SimSetup(config=config, latency=over.get("latency", LinearLatency())))


# ---------------------------------------------------------------------------- grid


def test_keys_are_stable_and_file_safe() -> None:
    p = SweepPoint("sarathi", 256, 0.25, 0.5, "qps", 0)
    assert p.key == "sarathi_c256_s0.25_q0.5_seed0"
    assert SweepPoint("vllm", None, 0.0, 0.8, "capacity", 1).key == "vllm_cany_s0_l0.8_seed1"
    assert SweepPoint("vllm", None, 0.0, 0.8, "capacity", 1).engine_chunk == DEFAULT_CHUNK_SIZE


def test_chunk_independent_policies_run_once() -> None:
    g = _grid(policies=("sarathi", "vllm", "orca", "simple_chunking"), seeds=(0, 1))
    assert g.independent_policies() == ("vllm", "orca")
    assert g.engines() == [
        ("sarathi", 32),
        ("sarathi", 256),
        ("vllm", None),
        ("orca", None),
        ("simple_chunking", 32),
        ("simple_chunking", 256),
    ]
    points = g.points()
    # 4 per-chunk engines + 2 once-engines, each 2 shares x 1 load x 2 seeds
    assert len(points) == 6 * 4
    assert len({p.key for p in points}) == len(points)
    assert {p.chunk for p in points if p.policy == "orca"} == {None}
    # a chunk above max_model_len changes vllm's budget: then it runs per chunk
    g2 = _grid(chunks=(32, 2048))
    assert g2.independent_policies() == ()
    assert ("vllm", 2048) in g2.engines()


def test_grid_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="chunks=.*duplicate"):
        _grid(chunks=(32, 32))
    with pytest.raises(ValueError, match="shares"):
        _grid(shares=(0.0, 1.5))
    with pytest.raises(ValueError, match="load_kind"):
        _grid(load_kind="rps")


# ---------------------------------------------------------------------------- mix


def test_mix_shares_and_seeds() -> None:
    spec = _mix(n=2000)
    none = build_mixed_workload(spec, share=0.0, qps=2.0, seed=3)
    assert {r.input_tokens for r in none} == {32}
    every = build_mixed_workload(spec, share=1.0, qps=2.0, seed=3)
    assert {r.input_tokens for r in every} == {400}
    quarter = build_mixed_workload(spec, share=0.25, qps=2.0, seed=3)
    frac = np.mean([r.input_tokens == 400 for r in quarter])
    assert abs(frac - 0.25) < 0.03
    # same seed, same workload (lengths, arrivals, prompts); another seed differs
    again = build_mixed_workload(spec, share=0.25, qps=2.0, seed=3)
    assert [(r.input_tokens, r.arrival_s) for r in again] == [
        (r.input_tokens, r.arrival_s) for r in quarter
    ]
    assert again[5].prompt_token_ids == quarter[5].prompt_token_ids
    other = build_mixed_workload(spec, share=0.25, qps=2.0, seed=4)
    assert [r.arrival_s for r in other] != [r.arrival_s for r in quarter]
    # raising the share only turns short requests long; doubling the rate halves times
    half = build_mixed_workload(spec, share=0.5, qps=2.0, seed=3)
    assert all(h.input_tokens == 400 for q, h in zip(quarter, half) if q.input_tokens == 400)
    fast = build_mixed_workload(spec, share=0.25, qps=4.0, seed=3)
    assert fast[-1].arrival_s == pytest.approx(quarter[-1].arrival_s / 2)
    assert all(r.arrival_s <= s.arrival_s for r, s in zip(quarter, quarter[1:]))


@pytest.mark.skipif(not DEFAULT_SHORT_TRACE.is_file(), reason="traces not in ../shared")
def test_mix_from_traces_fitted() -> None:
    spec = _mix(
        n=400,
        short=LengthSource(trace_path=str(DEFAULT_SHORT_TRACE)),
        long=LengthSource(trace_path=str(DEFAULT_LONG_TRACE)),
        length_scale=0.1,
        max_input_tokens=300,
        max_output_tokens=20,
    )
    reqs = build_mixed_workload(spec, share=0.5, qps=1.0, seed=0)
    assert max(r.input_tokens for r in reqs) <= 300 and max(r.output_tokens for r in reqs) <= 20
    long_src = [r.source_input_tokens for r in reqs if r.source_input_tokens > 2000]
    assert len(long_src) > 100  # arXiv prompts: median ~2.7k tokens


def test_length_source_errors() -> None:
    with pytest.raises(ValueError, match="needs trace_path"):
        LengthSource()
    with pytest.raises(ValueError, match="not both"):
        LengthSource(trace_path="x.csv", input_tokens=3, output_tokens=3)


# ---------------------------------------------------------------------------- metrics


def _it(step: int, start: float, dur: float, prefill: int, decodes: int) -> IterationSample:
    return IterationSample(
        step=step,
        start_s=start,
        end_s=start + dur,
        num_prefill_tokens=prefill,
        num_decode_tokens=decodes,
        num_seqs=decodes + (1 if prefill else 0),
        num_decode_seqs=decodes,
    )


def test_stall_busy_and_utilization_by_hand() -> None:
    # median 0.1 -> gaps above 0.2 are stalls: 0.5 + 0.3
    assert stall_total([0.1, 0.1, 0.1, 0.5, 0.3]) == (pytest.approx(0.8), 2)
    assert stall_total([]) == (0.0, 0)
    its = [_it(1, 0.0, 0.1, 10, 0), _it(2, 0.5, 0.3, 50, 10)]
    assert busy_fraction(its, 2.0) == pytest.approx(0.2)
    assert busy_fraction(its, 0.0) is None
    # per iteration MFU 1e7/0.1/1e9 = 0.1 and 6e7/0.3/1e9 = 0.2; duration-weighted 0.175
    mfu, mbu = utilization(its, TokenCost(), 1e9, 1e6)
    assert mfu == pytest.approx(0.175)
    assert mbu == pytest.approx(70e3 / (1e6 * 0.4))
    assert utilization(its, None, 1e9, 1e6) == (None, None)
    assert utilization(its, TokenCost(), None, 1e6)[0] is None


def test_point_row_by_hand() -> None:
    a = RequestRecord("a", 0.0, 0.0, 0.0, [0.5, 0.6, 0.7, 1.2], 10, 4)
    b = RequestRecord("b", 0.2, 0.2, 0.2, [1.0, 1.1], 20, 2)
    its = [_it(1, 0.0, 0.5, 30, 0), _it(2, 0.5, 0.7, 0, 2)]
    row, summary = point_row([a, b], its, slo_tbt=0.3)
    # makespan 1.2 s; 6 output tokens, 36 tokens in all
    assert row["output_tokens_per_s"] == pytest.approx(6 / 1.2)
    assert row["total_tokens_per_s"] == pytest.approx(36 / 1.2)
    # TTFTs 0.5, 0.8; TBTs 0.1 0.1 0.5 | 0.1
    assert row["ttft_p50_s"] == pytest.approx(0.65)
    assert row["tbt_p50_s"] == pytest.approx(0.1)
    assert row["tbt_p95_s"] == pytest.approx(np.percentile([0.1, 0.1, 0.5, 0.1], 95))
    assert row["decode_stall_p99_s"] == pytest.approx(np.percentile([0.5, 0.1], 99))
    assert row["stall_total_s"] == pytest.approx(0.5) and row["stall_count"] == 1
    assert row["busy_fraction"] == pytest.approx(1.0)
    # a's P99 TBT ~0.49 > 0.3: only b is good
    assert row["slo_attainment"] == pytest.approx(0.5)
    assert row["goodput_rps"] == pytest.approx(1 / 1.2)
    assert summary["num_completed"] == 2


def test_best_chunk_rule() -> None:
    cells = {
        32: {"tbt_p99_s": 0.05, "goodput_rps": 1.0},
        256: {"tbt_p99_s": 0.15, "goodput_rps": 2.0},
        1024: {"tbt_p99_s": 0.5, "goodput_rps": 3.0},
    }
    assert best_chunk(cells, None) == 32
    assert best_chunk(cells, 0.2) == 256
    assert best_chunk(cells, 0.01) is None


# ---------------------------------------------------------------------------- store


def test_corrupt_or_keyless_line_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / POINTS_JSONL).write_text('{"key": "a"}\n{"key": \n')
    with pytest.raises(SweepFileError, match="line 2 is not valid JSON"):
        read_points(tmp_path)
    (tmp_path / POINTS_JSONL).write_text('{"key": "a"}\n\n{"nokey": 1}\n')
    with pytest.raises(SweepFileError, match="no string 'key'"):
        read_points(tmp_path)


def test_machine_change_flags_sessions() -> None:
    sessions = [
        {"session": "s1", "probe_start": [100.0, 10.0]},
        {"session": "s1", "probe_end": [110.0, 10.5]},  # within 15 %
        {"session": "s2", "probe_start": [101.0, 10.0]},
        {"session": "s2", "probe_end": [60.0, 10.0]},  # GEMM dropped 40 %
        {"session": "s3", "probe_start": [100.0, 7.0]},  # bandwidth 30 % below s1
        {"session": "s4", "probe_start": None},
    ]
    assert changed_sessions(sessions) == {"s2", "s3"}
    # MFU/MBU measured against the probe are redone with the session's best probe
    point = {
        "key": "k",
        "session": "s2",
        "limits": "probe",
        "busy_s": 2.0,
        "iteration_flops": 101.0,
        "iteration_bytes": 10.0,
        "mfu": 9.9,
    }
    (flagged,) = flag_points([point], sessions)
    assert flagged["machine_changed"] and flagged["mfu"] == pytest.approx(0.5)
    assert flagged["mbu"] == pytest.approx(0.5)
    (fixed,) = flag_points([{**point, "limits": "fixed"}], sessions)
    assert fixed["mfu"] == 9.9


# ---------------------------------------------------------------------------- end to end


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip()]


def test_simulated_sweep_and_resume(tmp_path: Path) -> None:
    grid, mix = _grid(), _mix()
    settings = SweepSettings(
        slo_tbt=0.004,
        cost=TokenCost(),
        peak_flops=1e12,
        bandwidth=1e9,
        keep_runs=False,
        mode="simulate",
    )
    log: list[str] = []
    data = run_sweep(
        grid, mix, tmp_path, _sim(), settings, echo=log.append, probe=lambda: (1e12, 1e9)
    )
    # sarathi: 2 chunks x 2 shares; vllm once per share
    assert len(_lines(tmp_path / POINTS_JSONL)) == 6
    assert any("chunk-independent" in m and "vllm" in m for m in log)
    by_key = {p["key"]: p for p in data["points"]}
    assert by_key["vllm_cany_s0.5_q200_seed0"]["chunk"] is None
    for p in by_key.values():
        assert p["num_completed"] == 24 and p["mfu"] > 0 and not p["machine_changed"]
        assert 0 < p["busy_fraction"] <= 1.0 + 1e-9
    # with long prompts, small chunks keep TBT tails short; vllm's whole prefills stall
    small, big = by_key["sarathi_c32_s0.5_q200_seed0"], by_key["sarathi_c256_s0.5_q200_seed0"]
    assert small["tbt_p99_s"] < big["tbt_p99_s"] < by_key["vllm_cany_s0.5_q200_seed0"]["tbt_p99_s"]
    assert not (tmp_path / "points").exists()  # keep_runs=False
    rows = list(csv.DictReader((tmp_path / "points.csv").open()))
    assert len(rows) == 6 and rows[0]["tbt_p95_s"]
    for name in ("sweep.json", "frontier.png", "best_chunk.png", "chunk_sarathi_q200.png"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "sweep.json").read_text())["grid"]["num_points"] == 6
    assert {e["share"]: e["best_chunk"] for e in data["best_chunks"]}[0.5] == 32

    # a rerun runs nothing; a second seed runs only the new points, honouring one
    # appended by hand
    log.clear()
    run_sweep(grid, mix, tmp_path, _sim(), settings, echo=log.append)
    assert "6 already in points.jsonl (skipped), 0 to run" in log[0]
    assert len(_lines(tmp_path / POINTS_JSONL)) == 6
    hand = {
        "key": "sarathi_c32_s0_q200_seed1",
        "policy": "sarathi",
        "chunk": 32,
        "share": 0.0,
        "load": 200.0,
        "load_kind": "qps",
        "seed": 1,
        "tbt_p99_s": 123.0,
    }
    with (tmp_path / POINTS_JSONL).open("a") as f:
        f.write(json.dumps(hand) + "\n")
    log.clear()
    data = run_sweep(_grid(seeds=(0, 1)), mix, tmp_path, _sim(), settings, echo=log.append)
    assert "7 already in points.jsonl (skipped), 5 to run" in log[0]
    assert len(_lines(tmp_path / POINTS_JSONL)) == 12
    assert {p["key"]: p for p in data["points"]}[hand["key"]]["tbt_p99_s"] == 123.0
    # another workload in the same folder would be skipped by key: refused
    with pytest.raises(SweepFileError, match="another workload .*num_requests"):
        run_sweep(grid, _mix(n=30), tmp_path, _sim(), settings, echo=log.append)
    # a corrupt line stops the rerun with the line named
    with (tmp_path / POINTS_JSONL).open("a") as f:
        f.write("not json\n")
    with pytest.raises(SweepFileError, match="line 13"):
        run_sweep(grid, mix, tmp_path, _sim(), settings, echo=log.append)


def test_capacity_measured_once_and_reused(tmp_path: Path) -> None:
    mix = _mix(n=10)
    caps = capacities(tmp_path, _sim(), mix, (0.0, 0.5), "sarathi", 256, 0, echo=lambda _: None)
    assert caps[0.0] > caps[0.5] > 0  # long prompts take longer to serve

    @contextlib.contextmanager
    def unused(policy: str, chunk: int) -> Iterator[None]:
        raise AssertionError("capacity.json should have been reused")
        yield None

    assert capacities(tmp_path, unused, mix, (0.0, 0.5), "sarathi", 256, 0) == caps  # type: ignore[arg-type]
    grid = _grid(policies=("sarathi",), chunks=(64,), loads=(0.5,), load_kind="capacity")
    data = run_sweep(
        grid,
        mix,
        tmp_path,
        _sim(),
        SweepSettings(keep_runs=False),
        caps=caps,
        echo=lambda _: None,
        plot=False,
    )
    qps = {p["share"]: p["qps"] for p in data["points"]}
    assert qps == {s: pytest.approx(0.5 * caps[s]) for s in (0.0, 0.5)}


def test_cli_simulated_quick_sweep_with_measured_capacity(tmp_path: Path) -> None:
    args = [
        "sweep",
        "--simulate",
        "--gpu",
        "a100",
        "--arch",
        "mistral-7b",
        "--quick",
        "--policies",
        "sarathi,orca",
        "--short-input",
        "64",
        "--long-input",
        "1024",
        "--output-tokens",
        "8",
        "--vocab-size",
        "32000",
        "--avoid-ids",
        "",
        "--slo-tbt",
        "0.1",
        "--output-dir",
        str(tmp_path),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    # --quick: chunks 64,256 x shares 0,0.5 at 0.5 x capacity; orca once per share
    assert "6 to run" in r.output and "chunk-independent" in r.output
    assert "capacity at share 0.5" in r.output
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["mode"] == "simulate" and len(data["points"]) == 6
    caps = {float(k): v for k, v in data["capacity_qps"].items()}
    for p in data["points"]:
        assert p["qps"] == pytest.approx(0.5 * caps[p["share"]])
        assert 0 < p["mfu"] < 1 and p["num_completed"] == 8
    assert "best chunk per share" in r.output
    # a corrupt line is a one-line error naming it
    with (tmp_path / POINTS_JSONL).open("a") as f:
        f.write("{oops\n")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "line 7 is not valid JSON" in r.output
    assert "Traceback" not in r.output


def test_cli_simulated_sweep_from_a_profile(tmp_path: Path) -> None:
    """--profile: the profile's model times iterations, its machine probe is what MFU and
    MBU are measured against."""
    model = {
        "kind": "piecewise_linear",
        "knee": 8,
        "c0": 2e-3,
        "c_tok": 1e-4,
        "c_pairs": 1e-8,
        "c_ctx": 1e-7,
        "c_seq": 1e-5,
        "c_sampled": 1e-5,
    }
    profile = {
        "model": model,
        "machine": {"gemm_flops": 1e11, "bandwidth_bytes_s": 1e10},
    }
    (tmp_path / "p.json").write_text(json.dumps(profile))
    out = tmp_path / "out"
    args = [
        "sweep",
        "--simulate",
        "--profile",
        str(tmp_path / "p.json"),
        "--policies",
        "sarathi,vllm",
        "--chunks",
        "32,128",
        "--shares",
        "0.25",
        "--qps",
        "3",
        "--short-input",
        "32",
        "--long-input",
        "300",
        "--output-tokens",
        "8",
        "--num-requests",
        "10",
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "512",
        "--vocab-size",
        "1000",
        "--avoid-ids",
        "",
        "--output-dir",
        str(out),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    data = json.loads((out / "sweep.json").read_text())
    assert data["machine"] == {"peak_flops": 1e11, "bandwidth": 1e10}
    assert data["geometry"] == {"block_size": 16, "num_blocks": 256, "max_model_len": 512}
    assert data["grid"]["chunk_independent_policies"] == ["vllm"]
    assert len(data["points"]) == 3 and all(p["mfu"] > 0 for p in data["points"])


def test_cli_argument_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["sweep", "--output-dir", str(tmp_path)]
    r = runner.invoke(main, [*base, "--qps", "1", "--load", "0.5"])
    assert r.exit_code == 2 and "exactly one of --qps and --load" in r.output
    r = runner.invoke(main, [*base, "--qps", "1", "--profile", "p.json"])
    assert r.exit_code == 2 and "--simulate" in r.output
    r = runner.invoke(main, [*base, "--qps", "1", "--policies", "sarathi,nope"])
    assert r.exit_code == 2 and "nope" in r.output
    r = runner.invoke(main, [*base, "--qps", "1", "--chunks", "32,abc"])
    assert r.exit_code == 2 and "--chunks" in r.output
    r = runner.invoke(main, [*base, "--capacity-qps", "2", "--qps", "1"])
    assert r.exit_code == 2 and "only with --load" in r.output


# ---------------------------------------------------------------------------- real


@pytest.mark.model
def test_quick_sweep_on_a_real_deployment(tmp_path: Path) -> None:
    """One deployment of the default model (tiny lengths, one thread) runs two points
    (shares 0 and 0.5, warm-up once); a rerun starts nothing and skips both."""
    args = [
        "sweep",
        "--quick",
        "--policies",
        "sarathi",
        "--chunks",
        "64",
        "--shares",
        "0,0.5",
        "--qps",
        "4",
        "--short-input",
        "16",
        "--long-input",
        "96",
        "--output-tokens",
        "4",
        "--num-requests",
        "5",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "128",
        "--threads",
        "1",
        "--vocab-size",
        "49152",
        "--avoid-ids",
        "0-16",
        "--slo-tbt",
        "5",
        "--output-dir",
        str(tmp_path),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "2 to run" in r.output and r.output.count("deployment sarathi chunk 64 ready") == 1
    points = read_points(tmp_path)
    assert set(points) == {"sarathi_c64_s0_q4_seed0", "sarathi_c64_s0.5_q4_seed0"}
    for p in points.values():
        assert p["num_completed"] == 5 and p["num_errors"] == 0
        assert p["tbt_p99_s"] > 0 and p["mfu"] > 0 and p["slo_attainment"] == 1.0
    summary = json.loads(
        (tmp_path / "points" / "sarathi_c64_s0.5_q4_seed0" / "summary.json").read_text()
    )
    # its short requests repeat the share-0 point's prompts: the cache was emptied between
    assert summary["prefix_cache"]["queries"] > 0 and summary["prefix_cache"]["hits"] == 0
    assert "best chunk per share" in r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "2 already in points.jsonl (skipped), 0 to run" in r.output
    assert "deployment sarathi" not in r.output


def test_cli_simulated_sweep_passes_the_tbt_target_to_sarathi_only(tmp_path: Path) -> None:
    """--tbt-slo reaches the simulated sarathi points (their chunk is then an upper bound)
    and is left off the policies that have no budget to adapt, instead of failing them."""
    out = tmp_path / "out"
    args = ["sweep", "--simulate", "--gpu", "a100", "--arch", "mistral-7b",
            "--policies", "sarathi,vllm", "--chunks", "512", "--shares", "0.25",
            "--qps", "2", "--short-input", "64", "--long-input", "1500",
            "--output-tokens", "16", "--num-requests", "12", "--tbt-slo", "0.05",
            "--keep-runs", "--output-dir", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    # a simulated point records its engine config as a real run does (nested, as the
    # EngineConfig), not a hand-built flat dict
    engines = {
        d.name.split("_")[0]: json.loads((d / "summary.json").read_text())["settings"]["engine"][
            "scheduler"
        ]
        for d in (out / "points").iterdir()
    }
    assert engines["sarathi"]["tbt_slo"] == 0.05
    assert engines["vllm"]["tbt_slo"] == 0.0
