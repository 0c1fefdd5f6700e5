"""End-to-end replay: the driver and the `sarazmq replay` / `capacity` commands against a
real deployment of the default model (one deployment for the module), plus the CLI's
argument handling (no model needed)."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from sarazmq.cli import main
from sarazmq.cli.workload_options import workload_spec
from sarazmq.config import CacheConfig, EngineConfig, SchedulerConfig
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.replay.describe import describe
from sarazmq.replay.driver import clock_check, replay, replay_detailed
from sarazmq.replay.metrics import RequestRecord, summarize
from sarazmq.replay.report import write_run
from sarazmq.replay.vocabulary import parse_id_ranges
from sarazmq.replay.workload import WorkloadSpec, build_workload

AZURE_CONV = Path(__file__).parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"
# the traces live in ../shared beside the repository (as in CI); skip, like test_replay.py
needs_traces = pytest.mark.skipif(
    not AZURE_CONV.is_file(), reason=f"real traces not found at {AZURE_CONV}"
)
VOCAB = 49152
SPECIAL = tuple(range(17))  # SmolLM2's special tokens
RUN_FILES = (
    "summary.json",
    "requests.csv",
    "iterations.csv",
    "records.jsonl",
    "tbt_cdf.png",
    "ttft_cdf.png",
    "tokens_over_time.png",
    "iteration_tokens.png",
)
VOCAB_ARGS = ["--vocab-size", str(VOCAB), "--avoid-ids", "0-16"]


@pytest.fixture(scope="module")
def deployment():
    from sarazmq.procs.launcher import Deployment

    # One torch thread: on a shared 2-core machine more threads oversubscribe the cores
    # and each iteration gets several times slower.
    config = EngineConfig(
        num_threads=1,
        dtype="float32",
        scheduler=SchedulerConfig(policy="sarathi", chunk_size=64, max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks=512),
    )
    with Deployment(config) as dep:
        yield dep


# ---------------------------------------------------------------------------- with a model


@pytest.mark.model
@needs_traces
def test_replay_azure_records_and_outputs(deployment, tmp_path: Path) -> None:
    spec = WorkloadSpec(
        vocab_size=VOCAB,
        avoid_ids=SPECIAL,
        trace_path=AZURE_CONV,
        max_requests=6,
        max_input_tokens=64,
        max_output_tokens=8,
        time_scale=0.1,  # the first six rows span ~6.6 s: about 0.66 s here
    )
    requests = build_workload(spec)
    out = asyncio.run(replay_detailed(deployment.endpoint, requests, progress=False))
    records, iterations = out.records, out.iterations

    assert [r.request_id for r in records] == [q.request_id for q in requests]
    assert all(r.ok for r in records), [r.error for r in records]
    assert clock_check(records) == ""
    for req, rec in zip(requests, records):
        assert rec.finish_reason == "length"
        assert rec.num_prompt_tokens == req.input_tokens
        assert rec.num_output_tokens == req.output_tokens
        assert len(rec.token_times_s) == req.output_tokens
        assert len(rec.client_token_times_s or []) == req.output_tokens
        # sent on time (never early), and the server's times follow the send
        assert rec.arrival_s >= out.start_s + req.arrival_s - 5e-3
        assert rec.server_arrival_s is not None and rec.first_scheduled_s is not None
        assert rec.arrival_s <= rec.server_arrival_s <= rec.first_scheduled_s
        assert rec.first_scheduled_s < rec.token_times_s[0]
        assert rec.token_times_s == sorted(rec.token_times_s)
        # a token reaches the client after the server produced it
        assert all(c >= s for c, s in zip(rec.client_token_times_s or [], rec.token_times_s))

    summary = summarize(records, iterations)
    n_out = sum(q.output_tokens for q in requests)
    assert summary["num_completed"] == 6 and summary["num_errors"] == 0
    assert summary["ttft_s"]["count"] == 6 and summary["ttft_s"]["p50"] > 0
    assert summary["tbt_s"]["count"] == n_out - 6  # n - 1 gaps per request
    assert summary["tbt_s"]["p50"] > 0
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(
        n_out / summary["makespan_s"]
    )
    # The scheduler's iterations of the run account for every token (the warm-up
    # request ran before the run's first step and is not among them; its prompt is the
    # first request's first tokens, so prefix-cache hits are computed by nobody).
    assert iterations and summary["total_preemptions"] == 0
    hits = sum(it.cache_hits for it in iterations)
    assert summary["prefix_cache"]["hits"] == hits
    assert sum(it.num_prefill_tokens for it in iterations) + hits == sum(
        q.input_tokens for q in requests
    )
    assert sum(it.num_decode_tokens for it in iterations) == n_out - 6
    assert all(it.num_prefill_tokens <= 64 + it.num_decode_tokens for it in iterations)
    assert [it.step for it in iterations] == sorted({it.step for it in iterations})

    paths = write_run(tmp_path, summary, records, iterations, workload=describe(spec, requests))
    for name in RUN_FILES:
        assert (tmp_path / name).stat().st_size > 0, name
    assert set(paths.values()) == {tmp_path / name for name in RUN_FILES}
    with (tmp_path / "requests.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6
    with (tmp_path / "iterations.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(iterations)


@pytest.mark.model
def test_replay_records_a_rejected_request_as_an_error(deployment) -> None:
    # 1100 prompt tokens exceed max_model_len=1024: the server rejects it, the replay
    # records the error and still completes the other request.
    spec = WorkloadSpec(
        vocab_size=VOCAB,
        avoid_ids=SPECIAL,
        lengths="uniform",
        input_range=(1100, 1100),
        output_range=(3, 3),
        max_requests=1,
        arrivals="all_at_once",
    )
    bad = build_workload(spec)
    good = build_workload(
        WorkloadSpec(
            vocab_size=VOCAB,
            avoid_ids=SPECIAL,
            input_tokens=16,
            output_tokens=3,
            max_requests=1,
            arrivals="all_at_once",
        )
    )
    requests = [bad[0], dataclasses.replace(good[0], request_id="req-1")]
    records, _ = asyncio.run(replay(deployment.endpoint, requests, progress=False))
    assert isinstance(records[0], RequestRecord)
    assert not records[0].ok and "1100" in records[0].error
    assert records[1].ok and records[1].num_output_tokens == 3
    summary = summarize(records)
    assert summary["num_errors"] == 1 and summary["num_completed"] == 1


@pytest.mark.model
def test_cli_replay_connect(deployment, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = [
        "replay",
        "fixed",
        "--connect",
        deployment.endpoint,
        "--max-requests",
        "3",
        "--input-tokens",
        "24",
        "--output-tokens",
        "5",
        "--arrivals",
        "all_at_once",
        "--slo-ttft",
        "60",
        "--slo-tbt",
        "30",
        "--output-dir",
        str(out_dir),
        "--no-progress",
        *VOCAB_ARGS,
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "requests: 3  lengths: fixed  arrivals: all_at_once" in result.output
    assert "TTFT" in result.output and "requests: 3/3 completed, 0 errors" in result.output
    for name in RUN_FILES:
        assert (out_dir / name).stat().st_size > 0, name
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_completed"] == 3
    assert summary["tbt_s"]["count"] == 3 * 4
    assert summary["goodput"]["num_good"] == 3  # generous SLOs
    assert summary["workload"]["spec"]["input_tokens"] == 24
    assert summary["settings"]["engine"] == {"connected": True}


@pytest.mark.model
def test_cli_capacity_connect(deployment, tmp_path: Path) -> None:
    # Generous SLOs: both probes pass, and the search stops at its probe limit.
    args = [
        "capacity",
        "fixed",
        "--connect",
        deployment.endpoint,
        "--policies",
        "sarathi",
        "--max-requests",
        "2",
        "--input-tokens",
        "16",
        "--output-tokens",
        "3",
        "--slo-tbt",
        "60",
        "--slo-sched-delay",
        "60",
        "--lo-qps",
        "5",
        "--hi-qps",
        "10",
        "--max-probes",
        "2",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        *VOCAB_ARGS,
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "capacity.json").read_text())
    res = data["results"]["sarathi"]
    assert [p["qps"] for p in res["probes"]] == [5, 10]
    assert all(p["ok"] for p in res["probes"])
    assert res["capacity_qps"] == 10 and res["stop_reason"] == "max_iters"
    assert (tmp_path / "sarathi" / "qps-10" / "summary.json").is_file()
    assert "sarathi: capacity 10 req/s" in result.output


# ---------------------------------------------------------------------------- no model


def test_parse_id_ranges() -> None:
    assert parse_id_ranges("0-3, 7,5-5") == (0, 1, 2, 3, 5, 7)
    assert parse_id_ranges("") == ()
    for bad in ("a", "3-1", "-2", "1-x"):
        with pytest.raises(ValueError, match="--avoid-ids"):
            parse_id_ranges(bad)


@needs_traces
def test_workload_spec_from_options() -> None:
    base = {
        "trace_kind": "auto",
        "input_tokens": 10,
        "output_tokens": 2,
        "input_range": (1, 5),
        "output_range": (1, 5),
        "zipf_theta": 1.1,
        "arrivals": "auto",
        "qps": 2.0,
        "cv": 1.0,
        "max_requests": 4,
        "start": 0,
        "time_scale": 1.0,
        "length_scale": 1.0,
        "max_input_tokens": None,
        "max_output_tokens": None,
        "min_input_tokens": 1,
        "min_output_tokens": 1,
        "prefix_sharing": False,
        "seed": 0,
    }
    spec = workload_spec("zipf", base, 100, (0,))
    assert spec.trace_path is None and spec.lengths == "zipf" and spec.qps == 2.0
    spec = workload_spec(str(AZURE_CONV), {**base, "qps": None}, 100, ())
    assert spec.resolved_lengths() == "trace" and spec.resolved_arrivals() == "trace"
    with pytest.raises(ValueError, match="neither a file nor"):
        workload_spec("no-such-trace.csv", base, 100, ())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["fixed", "--compare", "sarathi,bogus"], "bogus"),
        (["fixed", "--compare", "sarathi,vllm", "--connect", "ipc:///nowhere"], "--connect"),
        (["fixed", "--compare", "sarathi,orca", "--baseline", "vllm"], "vllm"),
        (["fixed", "--slo-tbt", "0"], "--slo-tbt"),
        (["missing.csv"], "neither a file nor"),
        (["fixed", "--max-requests", "2"], "qps"),  # no arrival process
        (["fixed", "--avoid-ids", "9-1"], "--avoid-ids"),
    ],
)
def test_cli_replay_rejects_bad_arguments(extra: list[str], message: str) -> None:
    # Every case fails before any deployment is started or connected to.
    args = ["replay", *extra, "--vocab-size", "100"]
    if "--compare" not in extra:
        args += ["--connect", "ipc:///nowhere"]
    if "--avoid-ids" not in extra:
        args += ["--avoid-ids", ""]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output


@pytest.mark.model
def test_cli_replay_dashboard_shows_the_run(deployment, tmp_path: Path) -> None:
    """`replay --dashboard` serves the page while the trace runs, pointed at the
    deployment it replays against, and counts the replayed requests."""
    port = free_tcp_port()
    args = [
        "replay", "fixed", "--connect", deployment.endpoint, "--max-requests", "4",
        "--input-tokens", "150", "--output-tokens", "6", "--qps", "4",
        "--output-dir", str(tmp_path / "run"), "--no-progress", "--dashboard",
        "--dashboard-port", str(port), "--dashboard-linger", "3", *VOCAB_ARGS,
    ]  # fmt: skip
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.update(out=CliRunner().invoke(main, args)))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        snap = None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            while time.monotonic() < deadline:
                try:
                    snap = http.get("/dashboard/state").json()
                except httpx.HTTPError:
                    snap = None
                if snap and snap["requests"]["finished"] == 4:
                    break
                time.sleep(0.3)
            assert snap is not None and snap["requests"]["finished"] == 4, snap
            assert snap["label"] == deployment.endpoint and snap["api"] is False
            its = snap["iterations"]["0"]
            assert sum(i["prefill"] for i in its) >= 4 * 150 - 150  # the prompts ran here
            assert all(i["prefill"] + i["decode"] <= i["budget"] for i in its)
            assert snap["latency"]["num_requests"] == 4
            assert http.get("/dashboard").status_code == 200
    finally:
        thread.join(timeout=120)
    out = result["out"]
    assert out.exit_code == 0, out.output  # type: ignore[attr-defined]
    assert f"dashboard: http://127.0.0.1:{port}/dashboard" in out.output  # type: ignore[attr-defined]


def test_cli_replay_dashboard_errors_are_one_line() -> None:
    result = CliRunner().invoke(
        main, ["replay", "fixed", "--dashboard", "--openai-url", "http://127.0.0.1:9/v1"]
    )
    assert result.exit_code != 0 and "that server's own /dashboard" in result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["replay", "fixed", "--connect", "ipc:///nowhere", "--dashboard",
                "--dashboard-port", str(port), "--vocab-size", "100", "--avoid-ids", ""]  # fmt: skip
        result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert f"the dashboard could not listen on 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output
