"""Tests of the engine-independent replay harness: trace readers, workloads, metrics,
report files and the capacity search. No model, no deployment."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from sarazmq.replay.capacity import find_capacity, judge
from sarazmq.replay.describe import describe, format_header
from sarazmq.replay.distributions import (
    gamma_arrivals,
    poisson_arrivals,
    uniform_lengths,
    zipf_lengths,
)
from sarazmq.replay.metrics import (
    IterationSample,
    RequestRecord,
    distribution,
    request_metrics,
    summarize,
)
from sarazmq.replay.report import (
    format_comparison,
    format_table,
    read_run,
    write_comparison,
    write_run,
)
from sarazmq.replay.traces import TraceRow, detect_kind, load_trace
from sarazmq.replay.workload import WorkloadSpec, build_workload

TRACES = Path(__file__).parents[2] / "shared" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
AZURE_CODE = TRACES / "azure_llm_2023_code.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
SHAREGPT = TRACES / "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

needs_traces = pytest.mark.skipif(
    not all(p.is_file() for p in (AZURE_CONV, AZURE_CODE, MOONCAKE, SHAREGPT)),
    reason=f"real traces not found under {TRACES}",
)

VOCAB = 1000
AVOID = (0, 1, 2, 3, 999)


# ---------------------------------------------------------------------------- readers


@needs_traces
@pytest.mark.parametrize(
    ("path", "kind", "rows", "first", "second_arrival"),
    [
        (AZURE_CONV, "azure", 19_366, TraceRow(0.0, 374, 44), 4.314579),
        (AZURE_CODE, "azure", 8_819, TraceRow(0.0, 4808, 10), 0.052),
        (SHAREGPT, "sharegpt", 30_731, TraceRow(None, 74, 918), None),
    ],
)
def test_csv_readers_on_real_traces(
    path: Path, kind: str, rows: int, first: TraceRow, second_arrival: float | None
) -> None:
    assert detect_kind(path) == kind
    trace = load_trace(path)
    assert len(trace) == rows
    assert trace[0] == first
    if second_arrival is None:
        assert all(r.arrival_s is None for r in trace)
        assert (trace[1].input_tokens, trace[1].output_tokens) == (290, 905)
    else:
        assert trace[0].arrival_s == 0.0
        assert trace[1].arrival_s == pytest.approx(second_arrival, abs=1e-7)
        arrivals = [r.arrival_s for r in trace]
        assert all(b >= a for a, b in zip(arrivals, arrivals[1:], strict=False))
        # ~1 hour traces
        assert 3000 < arrivals[-1] < 3700


@needs_traces
def test_azure_last_row_and_explicit_kind() -> None:
    trace = load_trace(AZURE_CONV, kind="azure")
    # last row: 2023-11-16 19:14:08.4025270,197,183 ; first 18:15:46.6805900
    assert trace[-1].input_tokens == 197 and trace[-1].output_tokens == 183
    assert trace[-1].arrival_s == pytest.approx(58 * 60 + 21.721937, abs=1e-6)


@needs_traces
def test_mooncake_reader() -> None:
    assert detect_kind(MOONCAKE) == "mooncake"
    trace = load_trace(MOONCAKE)
    assert len(trace) == 12_031
    assert trace[0] == TraceRow(0.0, 6758, 500, tuple(range(14)))
    assert trace[1].hash_ids[0] == 0 and trace[1].hash_ids[1] == 14
    assert trace[-1].arrival_s == pytest.approx(3536.999)
    arrivals = [r.arrival_s for r in trace]
    assert all(b >= a for a, b in zip(arrivals, arrivals[1:], strict=False))
    # one hash id per 512-token block
    assert all(math.ceil(r.input_tokens / 512) == len(r.hash_ids) for r in trace[:500])


def test_reader_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="trace kind"):
        load_trace(bad)
    with pytest.raises(ValueError, match="kind="):
        load_trace(bad, kind="nope")
    with pytest.raises(ValueError, match="not a file"):
        load_trace(tmp_path / "missing.csv")
    az = tmp_path / "az.csv"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,x\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(az)
    ts = tmp_path / "ts.csv"
    ts.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        load_trace(ts)


def test_azure_timestamp_precision_across_midnight(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9999999,5,6\n"
        "2023-11-17 00:00:00.0000001,7,8\n"
        "2023-11-17 00:00:01,9,10\n"
    )
    rows = load_trace(p)
    assert rows[1].arrival_s == pytest.approx(2e-7, abs=1e-12)
    assert rows[2].arrival_s == pytest.approx(1.0000001, abs=1e-12)


# ---------------------------------------------------------------------------- generators


@pytest.mark.parametrize(
    ("qps", "cv", "tol"), [(4.0, 1.0, 0.03), (4.0, 0.5, 0.03), (2.0, 3.0, 0.06)]
)
def test_gamma_arrivals_rate_and_cv(qps: float, cv: float, tol: float) -> None:
    n = 50_000
    a = gamma_arrivals(n, qps, cv, np.random.default_rng(7))
    gaps = np.diff(a)
    assert a[0] == 0.0 and np.all(gaps >= 0)
    assert (n - 1) / a[-1] == pytest.approx(qps, rel=tol)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=tol)


def test_poisson_arrivals_rate_and_cv() -> None:
    n = 50_000
    a = poisson_arrivals(n, 10.0, np.random.default_rng(3))
    gaps = np.diff(a)
    assert (n - 1) / a[-1] == pytest.approx(10.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    # memoryless: P(gap > mean) = e^-1
    assert (gaps > 0.1).mean() == pytest.approx(math.exp(-1), abs=0.01)


def test_length_generators() -> None:
    rng = np.random.default_rng(0)
    u = uniform_lengths(20_000, 10, 20, rng)
    assert u.min() == 10 and u.max() == 20
    assert u.mean() == pytest.approx(15, abs=0.1)
    z = zipf_lengths(50_000, 1.2, 5, 50, rng)
    assert z.min() >= 5 and z.max() <= 50
    counts = np.bincount(z - 5, minlength=46)
    # P(lo + k) ∝ (k+1)^-theta: the ratio of the first two is 2^1.2
    assert counts[0] / counts[1] == pytest.approx(2**1.2, rel=0.05)
    assert counts[0] > counts[5] > counts[40]


# ---------------------------------------------------------------------------- workloads


def _spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec(vocab_size=VOCAB, avoid_ids=AVOID, **kw)  # type: ignore[arg-type]


def test_synthetic_all_at_once_fixed_lengths_exact_prompts() -> None:
    spec = _spec(max_requests=20, arrivals="all_at_once", input_tokens=37, output_tokens=5)
    reqs = build_workload(spec)
    assert len(reqs) == 20
    assert all(r.arrival_s == 0.0 for r in reqs)
    assert all(len(r.prompt_token_ids) == 37 and r.output_tokens == 5 for r in reqs)
    ids = np.array([t for r in reqs for t in r.prompt_token_ids])
    assert ids.min() >= 0 and ids.max() < VOCAB
    assert not np.isin(ids, AVOID).any()
    assert len({r.request_id for r in reqs}) == 20
    info = describe(spec, reqs)
    assert info["effective_qps"] is None and info["duration_s"] == 0.0
    json.dumps(info)


def test_synthetic_poisson_and_gamma_workloads() -> None:
    reqs = build_workload(_spec(max_requests=4000, qps=8.0, lengths="uniform"))
    times = np.array([r.arrival_s for r in reqs])
    assert np.all(np.diff(times) >= 0)
    info = describe(_spec(max_requests=4000, qps=8.0, lengths="uniform"), reqs)
    assert info["arrivals"] == "poisson"
    assert info["effective_qps"] == pytest.approx(8.0, rel=0.06)
    assert info["interarrival_cv"] == pytest.approx(1.0, rel=0.08)
    g = _spec(max_requests=4000, qps=8.0, arrivals="gamma", cv=2.0)
    ginfo = describe(g, build_workload(g))
    assert ginfo["interarrival_cv"] == pytest.approx(2.0, rel=0.12)
    z = build_workload(_spec(max_requests=300, qps=1.0, lengths="zipf", input_range=(4, 64)))
    assert all(4 <= r.input_tokens <= 64 for r in z)


@needs_traces
def test_trace_window_time_scale_and_clipping() -> None:
    rows = load_trace(AZURE_CONV)
    base = _spec(trace_path=str(AZURE_CONV), start=10, max_requests=50)
    reqs = build_workload(base)
    assert len(reqs) == 50
    assert reqs[0].source_index == 10 and reqs[0].arrival_s == 0.0
    assert reqs[0].input_tokens == rows[10].input_tokens
    assert reqs[0].output_tokens == rows[10].output_tokens
    for k, r in enumerate(reqs):
        assert r.arrival_s == pytest.approx(rows[10 + k].arrival_s - rows[10].arrival_s)
        assert len(r.prompt_token_ids) == rows[10 + k].input_tokens

    stretched = build_workload(WorkloadSpec(**{**base.__dict__, "time_scale": 3.0}))
    assert [r.arrival_s for r in stretched] == pytest.approx([3 * r.arrival_s for r in reqs])

    clipped_spec = WorkloadSpec(
        **{**base.__dict__, "max_input_tokens": 300, "max_output_tokens": 40}
    )
    clipped = build_workload(clipped_spec)
    window = rows[10:60]
    assert [r.input_tokens for r in clipped] == [min(w.input_tokens, 300) for w in window]
    assert [r.output_tokens for r in clipped] == [min(w.output_tokens, 40) for w in window]
    info = describe(clipped_spec, clipped)
    assert info["input_tokens"]["clipped_to_max"] == sum(w.input_tokens > 300 for w in window)
    assert info["output_tokens"]["clipped_to_max"] == sum(w.output_tokens > 40 for w in window)
    assert info["input_tokens"]["clipped_to_max"] > 0
    assert info["trace"] == {
        "path": str(AZURE_CONV),
        "rows_in_trace": 19_366,
        "start": 10,
        "rows_used": 50,
    }
    assert info["spec"]["max_input_tokens"] == 300
    assert _spec(trace_path=AZURE_CONV).trace_path == str(AZURE_CONV)  # Path accepted
    header = format_header(info)
    assert "rows 10..59 of 19366" in header and "clipped" in header


@needs_traces
def test_length_scale_min_tokens_and_qps_retiming() -> None:
    rows = load_trace(SHAREGPT)[:100]
    spec = _spec(
        trace_path=str(SHAREGPT),
        max_requests=100,
        qps=2.0,
        length_scale=0.01,
        min_input_tokens=4,
        min_output_tokens=2,
    )
    reqs = build_workload(spec)
    ordered = sorted(reqs, key=lambda r: r.source_index)
    for r, row in zip(ordered, rows, strict=True):
        assert r.input_tokens == max(4, math.floor(row.input_tokens * 0.01 + 0.5))
        assert r.output_tokens == max(2, math.floor(row.output_tokens * 0.01 + 0.5))
    info = describe(spec, reqs)
    assert info["arrivals"] == "poisson" and info["lengths"] == "trace"
    assert info["input_tokens"]["raised_to_min"] == sum(
        math.floor(r.input_tokens * 0.01 + 0.5) < 4 for r in rows
    )
    assert info["input_tokens"]["raised_to_min"] > 0


@needs_traces
def test_seeded_reproducibility() -> None:
    kw = dict(trace_path=str(SHAREGPT), max_requests=30, qps=1.0, max_input_tokens=64)
    a, b = build_workload(_spec(**kw)), build_workload(_spec(**kw))
    assert a == b
    c = build_workload(_spec(**kw, seed=1))
    assert a != c
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    # a row's prompt depends only on (seed, row): the same row in another window matches
    shifted = build_workload(_spec(**{**kw, "start": 5, "max_requests": 10}))
    by_src = {r.source_index: r.prompt_token_ids for r in a}
    assert all(by_src[r.source_index] == r.prompt_token_ids for r in shifted)


@needs_traces
def test_prefix_sharing_follows_hash_ids() -> None:
    spec = _spec(
        trace_path=str(MOONCAKE), max_requests=3, arrivals="all_at_once", prefix_sharing=True
    )
    a, b, _ = build_workload(spec)
    assert a.input_tokens == 6758 and b.input_tokens == 7322
    # rows 0 and 1 share hash id 0 (first 512 tokens) and nothing after
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]
    assert a.prompt_token_ids[512:1024] != b.prompt_token_ids[512:1024]


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="max_requests"):
        _spec(qps=1.0)
    with pytest.raises(ValueError, match="set qps"):
        _spec(max_requests=3)
    with pytest.raises(ValueError, match="needs qps"):
        _spec(max_requests=3, arrivals="gamma")
    with pytest.raises(ValueError, match="conflicts"):
        _spec(trace_path="x.csv", arrivals="trace", qps=2.0)
    with pytest.raises(ValueError, match="min_input_tokens"):
        _spec(max_requests=3, qps=1.0, min_input_tokens=0)
    with pytest.raises(ValueError, match="max_input_tokens"):
        _spec(max_requests=3, qps=1.0, max_input_tokens=2, min_input_tokens=3)
    with pytest.raises(ValueError, match="time_scale"):
        _spec(max_requests=3, qps=1.0, time_scale=0)
    with pytest.raises(ValueError, match="avoid_ids"):
        WorkloadSpec(vocab_size=2, avoid_ids=(0, 1), max_requests=1, qps=1.0)
    with pytest.raises(ValueError, match="lengths"):
        _spec(max_requests=3, qps=1.0, lengths="poisson")


@needs_traces
def test_trace_without_times_needs_an_arrival_process() -> None:
    with pytest.raises(ValueError, match="no arrival times"):
        build_workload(_spec(trace_path=str(SHAREGPT), max_requests=5))
    with pytest.raises(ValueError, match="past the end"):
        build_workload(_spec(trace_path=str(AZURE_CODE), start=10**6))


# ---------------------------------------------------------------------------- metrics


def _records() -> list[RequestRecord]:
    """Four requests with hand-picked timestamps (see the expected values below)."""
    return [
        RequestRecord(
            request_id="a",
            arrival_s=10.0,
            server_arrival_s=10.01,
            first_scheduled_s=10.1,
            token_times_s=[10.5, 10.6, 10.8, 11.1],
            num_prompt_tokens=100,
            num_output_tokens=4,
            finish_reason="length",
            num_preemptions=1,
            client_token_times_s=[10.52, 10.62, 10.83, 11.12],
        ),
        RequestRecord(
            request_id="b",
            arrival_s=10.2,
            server_arrival_s=10.2,
            first_scheduled_s=10.3,
            token_times_s=[11.0, 11.5],
            num_prompt_tokens=50,
            num_output_tokens=2,
            finish_reason="length",
        ),
        RequestRecord(
            request_id="c",
            arrival_s=10.4,
            server_arrival_s=None,
            first_scheduled_s=10.4,
            token_times_s=[10.9],
            num_prompt_tokens=30,
            num_output_tokens=1,
            finish_reason="length",
        ),
        RequestRecord(
            request_id="d",
            arrival_s=10.5,
            server_arrival_s=None,
            first_scheduled_s=None,
            token_times_s=[],
            num_prompt_tokens=20,
            num_output_tokens=0,
            error="boom",
        ),
    ]


def _iterations() -> list[IterationSample]:
    return [
        IterationSample(0, 10.1, 10.5, 100, 0, 1),
        IterationSample(1, 10.5, 10.6, 0, 1, 1),
        IterationSample(2, 10.6, 10.8, 50, 1, 2),
    ]


def _dist(d: dict, mean: float, p50: float, p90: float, p99: float, mx: float, n: int) -> None:
    assert d["count"] == n
    assert d["mean"] == pytest.approx(mean)
    assert d["p50"] == pytest.approx(p50)
    assert d["p90"] == pytest.approx(p90)
    assert d["p99"] == pytest.approx(p99)
    assert d["max"] == pytest.approx(mx)


def test_request_metrics_by_hand() -> None:
    m = request_metrics(_records()[0])
    assert m.ttft_s == pytest.approx(0.5)
    assert m.tbts_s == pytest.approx([0.1, 0.2, 0.3])
    assert m.tpot_s == pytest.approx(0.2)  # (11.1 - 10.5) / 3
    assert m.e2e_s == pytest.approx(1.1)
    assert m.scheduling_delay_s == pytest.approx(0.1)
    assert m.decode_stall_s == pytest.approx(0.3)
    assert m.tbt_p99_s == pytest.approx(0.298)  # 0.2 + 0.98 * 0.1
    assert m.ingress_delay_s == pytest.approx(0.01)
    assert m.client_ttft_s == pytest.approx(0.52)
    assert m.client_e2e_s == pytest.approx(1.12)
    single = request_metrics(_records()[2])
    assert single.tpot_s is None and single.decode_stall_s is None and single.tbts_s == []
    with pytest.raises(ValueError, match="non-decreasing"):
        request_metrics(RequestRecord("x", 0.0, None, None, [1.0, 0.5], 1, 2))


def test_summarize_by_hand() -> None:
    s = summarize(_records(), _iterations(), slo_ttft=0.6, slo_tbt=0.4)
    json.dumps(s, allow_nan=False)
    assert (s["num_requests"], s["num_completed"], s["num_errors"]) == (4, 3, 1)
    assert s["errors"] == ["d: boom"]
    assert s["finish_reasons"] == {"length": 3}
    # TTFT: a 0.5, b 0.8, c 0.5 -> sorted [0.5, 0.5, 0.8]
    _dist(s["ttft_s"], 0.6, 0.5, 0.74, 0.794, 0.8, 3)
    # TBT pooled: a [0.1, 0.2, 0.3], b [0.5] -> p90 at rank 2.7: 0.3 + 0.7 * 0.2
    _dist(s["tbt_s"], 0.275, 0.25, 0.44, 0.494, 0.5, 4)
    # TPOT: a 0.2, b 0.5 (c has one token)
    _dist(s["tpot_s"], 0.35, 0.35, 0.47, 0.497, 0.5, 2)
    # E2E: a 1.1, b 1.3, c 0.5
    _dist(s["e2e_s"], 2.9 / 3, 1.1, 1.26, 1.296, 1.3, 3)
    # scheduling delay: a 0.1, b 0.1, c 0.0
    _dist(s["scheduling_delay_s"], 0.2 / 3, 0.1, 0.1, 0.1, 0.1, 3)
    # decode stall: a 0.3, b 0.5
    _dist(s["decode_stall_s"], 0.4, 0.4, 0.48, 0.498, 0.5, 2)
    _dist(s["ingress_delay_s"], 0.005, 0.005, 0.009, 0.0099, 0.01, 2)
    _dist(s["client_ttft_s"], 0.52, 0.52, 0.52, 0.52, 0.52, 1)
    assert s["total_preemptions"] == 1 and s["num_preempted_requests"] == 1
    # makespan: first arrival 10.0 (d included) to last token 11.5
    assert s["makespan_s"] == pytest.approx(1.5)
    assert s["throughput"]["requests_per_s"] == pytest.approx(2.0)
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(120.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(7 / 1.5)
    # goodput: a good (TTFT 0.5, own P99 TBT 0.298); b TTFT 0.8 too slow; c good (no
    # TBT); d failed -> 2 of 4
    assert s["goodput"]["num_good"] == 2
    assert s["goodput"]["fraction"] == pytest.approx(0.5)
    assert s["goodput"]["requests_per_s"] == pytest.approx(2 / 1.5)
    it = s["iterations"]
    assert it["count"] == 3
    assert (it["num_mixed"], it["num_prefill_only"], it["num_decode_only"]) == (1, 1, 1)
    assert it["duration_s"]["mean"] == pytest.approx(0.7 / 3)
    assert it["busy_s"] == pytest.approx(0.7)
    assert it["busy_fraction"] == pytest.approx(0.7 / 1.5)
    assert it["prefill_tokens"]["max"] == 100 and it["batch_size"]["max"] == 2


def test_goodput_tbt_slo_uses_each_requests_own_p99() -> None:
    # only c (one token) passes: a's own P99 TBT 0.298 > 0.25, b's 0.5 > 0.25
    s = summarize(_records(), slo_tbt=0.25)
    assert s["goodput"]["num_good"] == 1
    # without SLOs every completed request is good
    assert summarize(_records())["goodput"]["num_good"] == 3


def test_distribution_empty_and_summary_of_nothing() -> None:
    assert distribution([]) == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }
    s = summarize([])
    assert s["makespan_s"] == 0.0 and s["throughput"]["requests_per_s"] is None
    json.dumps(s, allow_nan=False)
    with pytest.raises(ValueError, match="slo_tbt"):
        summarize(_records(), slo_tbt=0.0)


# ---------------------------------------------------------------------------- report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 5_000


def test_write_run_writes_every_file(tmp_path: Path) -> None:
    s = summarize(_records(), _iterations(), slo_ttft=0.6, slo_tbt=0.4)
    paths = write_run(
        tmp_path / "run", s, _records(), _iterations(), workload={"x": 1}, settings={"p": "s"}
    )
    expected = {
        "summary.json",
        "requests.csv",
        "iterations.csv",
        "records.jsonl",
        "tbt_cdf.png",
        "ttft_cdf.png",
        "tokens_over_time.png",
        "iteration_tokens.png",
    }
    assert {p.name for p in (tmp_path / "run").iterdir()} == expected
    assert {p.name for p in paths.values()} == expected
    for name in expected:
        if name.endswith(".png"):
            assert _is_png(tmp_path / "run" / name), name
    data = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert data["workload"] == {"x": 1} and data["settings"] == {"p": "s"}
    assert data["tbt_s"]["p99"] == pytest.approx(0.494)
    with (tmp_path / "run" / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["request_id"] for r in rows] == ["a", "b", "c", "d"]
    assert float(rows[0]["arrival_s"]) == 0.0  # relative to the first arrival
    assert float(rows[1]["first_token_s"]) == pytest.approx(1.0)
    assert float(rows[0]["tpot_s"]) == pytest.approx(0.2)
    assert rows[2]["tpot_s"] == "" and rows[3]["error"] == "boom"
    # records.jsonl gives the records back exactly (replay-diff reads runs this way)
    summary, records = read_run(tmp_path / "run")
    assert records == _records() and summary["num_requests"] == 4
    with (tmp_path / "run" / "iterations.csv").open() as f:
        its = list(csv.DictReader(f))
    assert len(its) == 3
    assert float(its[0]["start_s"]) == pytest.approx(0.1)
    assert int(its[2]["num_prefill_tokens"]) == 50


def test_write_run_with_no_iterations(tmp_path: Path) -> None:
    # a deployment that reports no per-iteration records still gets every file
    s = summarize(_records())
    write_run(tmp_path, s, _records(), [])
    assert _is_png(tmp_path / "iteration_tokens.png")
    assert (tmp_path / "iterations.csv").read_text().count("\n") == 1
    # overlapping (pipelined) and zero-length iterations still plot
    odd = [IterationSample(0, 10.0, 10.0, 5, 0, 1), IterationSample(1, 10.0, 10.3, 0, 3, 1)]
    odd.append(IterationSample(2, 10.2, 10.4, 0, 3, 1))
    write_run(tmp_path / "odd", summarize(_records(), odd), _records(), odd)
    assert _is_png(tmp_path / "odd" / "iteration_tokens.png")


def test_format_table() -> None:
    text = format_table(summarize(_records(), _iterations(), slo_ttft=0.6, slo_tbt=0.4))
    tbt_line = next(line for line in text.splitlines() if line.startswith("TBT"))
    # TBT in ms: n, mean, p50, p90, p99, max
    assert tbt_line.split()[1:] == ["4", "275.00", "250.00", "440.00", "494.00", "500.00"]
    assert "3/4 completed" in text and "1 errors" in text
    assert "2.000 req/s" in text and "120.0 input tok/s" in text
    assert "goodput" in text and "fraction 0.500" in text
    assert "iterations: 3 (1 mixed" in text


def test_comparison(tmp_path: Path) -> None:
    fast = _records()
    # the same requests with every token gap doubled
    slow = [
        RequestRecord(
            **{
                **r.__dict__,
                "token_times_s": [
                    r.token_times_s[0] + 2 * (t - r.token_times_s[0]) for t in r.token_times_s
                ],
            }
        )
        for r in fast
    ]
    summaries = {"sarathi": summarize(fast), "vllm": summarize(slow)}
    paths = write_comparison(tmp_path, summaries, {"sarathi": fast, "vllm": slow}, baseline="vllm")
    for key in ("tbt_cdf", "ttft_cdf"):
        assert _is_png(paths[key])
    data = json.loads(paths["comparison_json"].read_text())
    assert set(data["runs"]) == {"sarathi", "vllm"}
    assert data["ratios"]["sarathi"]["TBT p99 (ms)"] == pytest.approx(0.5)
    assert data["ratios"]["vllm"]["TBT p99 (ms)"] == pytest.approx(1.0)
    text = paths["comparison_txt"].read_text()
    assert text.strip() == format_comparison(summaries, "vllm")
    line = next(row for row in text.splitlines() if row.startswith("TBT p99 (ms)"))
    assert line.split()[3:] == ["494.00", "988.00", "0.50"]
    with pytest.raises(ValueError, match="baseline"):
        format_comparison(summaries, "orca")


# ---------------------------------------------------------------------------- capacity


def _synthetic_server(tbt_per_qps: float, sched_knee: float, calls: list[float]):
    """P99 TBT grows linearly with the rate; scheduling delay explodes past a knee."""

    def run(qps: float) -> dict:
        calls.append(qps)
        return {
            "num_completed": 10,
            "num_errors": 0,
            "tbt_s": {"p99": tbt_per_qps * qps},
            "scheduling_delay_s": {"p50": 0.01 if qps <= sched_knee else 10.0},
        }

    return run


def test_capacity_finds_tbt_threshold() -> None:
    calls: list[float] = []
    seen: list[float] = []
    # P99 TBT = 0.01 * qps, SLO 0.05 s -> capacity 5 req/s
    res = find_capacity(
        _synthetic_server(0.01, 1e9, calls),
        0.05,
        1.0,
        0.5,
        1.0,
        max_iters=30,
        rel_tol=0.01,
        on_probe=lambda p: seen.append(p.qps),
    )
    assert seen == calls
    assert res.stop_reason == "converged"
    assert res.capacity_qps is not None and res.lowest_failing_qps is not None
    assert 5.0 * 0.99 <= res.capacity_qps <= 5.0 < res.lowest_failing_qps
    assert res.lowest_failing_qps - res.capacity_qps <= 0.01 * res.capacity_qps
    assert [p.qps for p in res.probes] == calls
    # expansion doubled hi until it failed: 0.5, 1, 2, 4, 8, then bisection
    assert calls[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert all(p.ok == (p.qps <= 5.0) for p in res.probes)
    assert all("TBT" in p.reason for p in res.probes if not p.ok)
    json.dumps(res.to_dict())


def test_capacity_finds_sched_delay_threshold() -> None:
    calls: list[float] = []
    res = find_capacity(
        _synthetic_server(0.0, 3.0, calls), 0.05, 1.0, 1.0, 2.0, max_iters=30, rel_tol=0.02
    )
    assert res.capacity_qps == pytest.approx(3.0, rel=0.02)
    assert res.capacity_qps <= 3.0
    assert any("scheduling delay" in p.reason for p in res.probes)


def test_capacity_respects_iteration_bound() -> None:
    calls: list[float] = []
    res = find_capacity(_synthetic_server(0.01, 1e9, calls), 0.05, 1.0, 0.5, 1.0, max_iters=4)
    assert len(calls) == 4 and len(res.probes) == 4
    assert res.stop_reason == "max_iters"
    assert res.capacity_qps == 4.0 and res.lowest_failing_qps is None  # 0.5, 1, 2, 4 pass
    calls.clear()
    res = find_capacity(_synthetic_server(0.01, 1e9, calls), 0.05, 1.0, 0.5, 1.0, max_iters=7)
    assert len(calls) == 7 and res.stop_reason == "max_iters"
    assert res.capacity_qps is not None and res.lowest_failing_qps is not None
    assert res.capacity_qps <= 5.0 < res.lowest_failing_qps


def test_capacity_lo_fails_and_cap() -> None:
    calls: list[float] = []
    res = find_capacity(_synthetic_server(1.0, 1e9, calls), 0.05, 1.0, 0.5, 1.0)
    assert res.stop_reason == "lo_fails" and res.capacity_qps is None and calls == [0.5]
    calls.clear()
    res = find_capacity(_synthetic_server(0.0, 1e9, calls), 0.05, 1.0, 0.5, 1.0, max_qps=3.0)
    assert res.stop_reason == "cap" and res.capacity_qps == 3.0
    assert calls == [0.5, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="hi_qps"):
        find_capacity(_synthetic_server(0.0, 1e9, calls), 0.05, 1.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="max_iters"):
        find_capacity(_synthetic_server(0.0, 1e9, calls), 0.05, 1.0, 1.0, 2.0, max_iters=0)


def test_judge_fails_runs_with_errors_or_no_samples() -> None:
    ok = {"num_completed": 3, "tbt_s": {"p99": 0.01}, "scheduling_delay_s": {"p50": 0.0}}
    assert judge(1.0, ok, 0.05, 1.0).ok
    assert not judge(1.0, {**ok, "num_errors": 2}, 0.05, 1.0).ok
    assert not judge(1.0, {**ok, "tbt_s": {"p99": None}}, 0.05, 1.0).ok
    assert not judge(1.0, {**ok, "num_completed": 0}, 0.05, 1.0).ok
