"""`--dp N`: data-parallel replicas behind one frontend, over real processes and the real
default model: the same greedy outputs as one engine, every replica used, a replica's
death re-routes what it had not started streaming and fails only the rest, and the
replica rejoins the rotation once restarted."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sarazmq import LLM
from sarazmq.client import Client, EngineError, RequestError
from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.options import EngineOptions
from sarazmq.procs.launcher import Deployment
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model]

PROMPT = "Once upon a time, in a small village,"
LONG = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8)
ENGINE = dict(
    dtype="float32",  # compared with the in-process engine's outputs
    gguf_matmul="float",  # int8 roundings would follow how batches are composed
    chunk_size=64,
    max_num_seqs=2,  # a replica runs two requests: the others wait (and can be moved)
    max_model_len=512,
    num_kv_blocks=256,
    num_threads=1,
)


def dp_config(replicas: int, router: str) -> EngineConfig:
    return EngineOptions(data_parallel_size=replicas, router=router, **ENGINE).to_config()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The in-process engine's (one replica) greedy output for PROMPT."""
    llm = LLM(**ENGINE)  # type: ignore[arg-type]
    return llm.generate([PROMPT], LONG)[0].token_ids


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    with Deployment(
        dp_config(2, "round-robin"), DeploymentConfig(restart="on-failure", max_restarts=2)
    ) as dep:
        yield dep


def test_dp_refused_in_process_and_names_its_replicas(deployment: Deployment) -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM(data_parallel_size=2)
    names = set(deployment.pids)
    for r in (0, 1):
        assert {f"replica{r}-scheduler-0", f"replica{r}-worker-0"} <= names
    assert "frontend-0" in names


def test_replicas_serve_the_same_greedy_outputs_as_one_engine(
    deployment: Deployment, reference: list[int]
) -> None:
    with Client(deployment.endpoint) as client:
        outs = [client.generate(PROMPT, LONG) for _ in range(4)]
        stats = client.stats()
    assert all(o.token_ids == reference for o in outs)
    # round-robin: both replicas ran two of them
    sent = [r["num_sent"] for r in stats["frontend"]["router"]["instances"]]
    assert min(sent) >= 2, sent
    assert [r["alive"] for r in stats["replicas"]] == [True, True]
    assert stats["num_total_blocks"] == 2 * 256


def test_a_dead_replica_reroutes_unstarted_requests_and_rejoins(
    deployment: Deployment, reference: list[int]
) -> None:
    """Eight requests, four per replica (two running, two waiting on each): replica 1's
    worker is killed while its first two stream. Those two fail; its two waiting ones run
    on replica 0 instead, with the same output; nothing is lost or answered twice. The
    replica restarts and takes requests again."""
    results: dict[int, object] = {}
    with Client(deployment.endpoint) as client:
        stats = client.stats()
        before = stats["frontend"]["num_rerouted"]
        steps = [r["num_iterations"] for r in stats["replicas"]]

        def run(i: int) -> None:
            try:
                results[i] = client.generate(PROMPT, LONG, timeout=120)
            except (RequestError, EngineError) as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        # wait until replica 1 has started streaming (tokens iterate on both replicas)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = client.stats()
            now = [r.get("num_iterations", 0) for r in stats["replicas"]]
            if all(b - a >= 10 for a, b in zip(steps, now)):
                break
            time.sleep(0.1)
        os.kill(deployment.pids["replica1-worker-0"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert len(results) == 8
        failed = [r for r in results.values() if isinstance(r, Exception)]
        done = [r for r in results.values() if not isinstance(r, Exception)]
        assert len(failed) == 2, results
        assert all("replica1-worker-0" in str(e) for e in failed)
        assert all(o.token_ids == reference for o in done)  # type: ignore[attr-defined]
        stats = client.stats()
        assert stats["frontend"]["num_rerouted"] - before == 2
        # the replica comes back (restart="on-failure") and rejoins the rotation
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = client.stats()
            if all(r["alive"] for r in stats["replicas"]):
                break
            time.sleep(0.5)
        assert [r["alive"] for r in stats["replicas"]] == [True, True]
        assert deployment.instance_restarts == [0, 1]
        sent_before = stats["frontend"]["router"]["instances"][1]["num_sent"]
        for _ in range(4):
            assert client.generate(PROMPT, SHORT).finish_reason == "length"
        sent_after = client.stats()["frontend"]["router"]["instances"][1]["num_sent"]
        assert sent_after - sent_before == 2
