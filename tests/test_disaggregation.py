"""`serve --disaggregate`: prefill and decode instances over real processes and the real
default model. Outputs (tokens and text) equal the co-located engine's, with prefix-cache
hits on the prefill side and preemptions on the decode side; the KV moves and is freed
on both sides; a dead instance or a vanished client leaks nothing."""

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

ENGINE = dict(
    dtype="float32",  # compared with the in-process engine's outputs
    gguf_matmul="float",  # int8 roundings would follow how batches are composed
    chunk_size=64,
    max_model_len=512,
    num_kv_blocks=28,  # 448 tokens per instance: long outputs preempt on the decode side
    num_threads=1,
)
SYSTEM = (
    "You are a helpful assistant. You answer every question in one short paragraph of "
    "plain words, without lists, code or headings, and you never repeat the question. "
)
PROMPTS = [SYSTEM + q for q in ("Why is the sky blue?", "What is a prime number?",
                                "Name a large ocean.", "How do birds fly?")]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


def disagg_config(**over: object) -> EngineConfig:
    opts = {**ENGINE, **over}
    return EngineOptions(
        disaggregate=True, prefill_instances=1, decode_instances=1, **opts
    ).to_config()  # type: ignore[arg-type]  # noqa: E501


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], str]]:
    """The co-located in-process engine's greedy outputs (tokens, text)."""
    llm = LLM(**ENGINE)  # type: ignore[arg-type]
    return {p: (o.token_ids, o.text) for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    with Deployment(disagg_config(), DeploymentConfig(restart="on-failure")) as dep:
        yield dep


def _free(client: Client, timeout: float = 30.0) -> list[int]:
    """Each instance's free KV blocks, once every block is free again (or the timeout:
    then what is still taken shows)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        free = [r["num_free_blocks"] for r in stats["replicas"]]
        if free == [r["num_total_blocks"] for r in stats["replicas"]]:
            return free
        if time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_outputs_equal_the_colocated_engine_and_the_kv_is_freed(
    deployment: Deployment, reference: dict
) -> None:
    with Client(deployment.endpoint) as client:
        got: dict[str, tuple[list[int], str]] = {}

        def run(p: str) -> None:
            out = client.generate(p, GREEDY, timeout=120)
            got[p] = (out.token_ids, out.text)

        # one first: its system prompt's blocks are then cached on the prefill instance
        first = client.generate(PROMPTS[0], GREEDY, timeout=120)
        assert (first.token_ids, first.text) == reference[PROMPTS[0]]
        # then all four at once: the decode instance's 28 blocks cannot hold four
        # 130-token requests, so it preempts (and recomputes there)
        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert got == reference
        stats = client.stats()
        prefill, decode = stats["replicas"]
        assert decode["num_preemptions"] > 0
        # the shared system prompt is a prefix-cache hit on the prefill instance
        assert prefill["prefix_cache_hits"] > 0
        # every request's KV crossed once (a preempted one is recomputed, not re-pulled)
        assert decode["kv_pulls"] == 5 and decode["kv_pull_bytes"] > 0
        assert prefill["num_parked"] == 0
        assert _free(client) == [28, 28]


def test_a_dead_prefill_worker_leaks_nothing_and_the_instance_comes_back(
    deployment: Deployment,
) -> None:
    """Six requests with long prompts (one fits each pool at a time, so they move through
    the prefill instance one by one); its worker is killed meanwhile. The requests already
    decoding finish; the others fail (not streamed yet: no other prefill instance; mid-
    transfer: the pull fails); the instance restarts; neither pool leaks a block."""
    long = [SYSTEM * 3 + q for q in PROMPTS]
    results: dict[int, object] = {}
    with Client(deployment.endpoint) as client:

        def run(i: int) -> None:
            try:
                results[i] = client.generate(long[i % 4], GREEDY, timeout=120)
            except (RequestError, EngineError) as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(deployment.pids["prefill0-worker-0"], signal.SIGKILL)
        for t in threads:
            t.join(180)
        assert len(results) == 6
        failed = [r for r in results.values() if isinstance(r, Exception)]
        done = [r for r in results.values() if not isinstance(r, Exception)]
        assert done and failed, results
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in done)  # type: ignore[attr-defined]
        assert all("prefill0-worker-0" in str(e) or "KV" in str(e) for e in failed), failed
        # restart="on-failure": the prefill instance is back and serves; nothing leaked
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(r["alive"] for r in client.stats()["replicas"]):
                break
            time.sleep(0.5)
        out = client.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        assert out.finish_reason == "length"
        assert _free(client) == [28, 28]


def test_a_dead_decode_worker_fails_its_requests_and_the_prefill_side_frees_theirs(
    deployment: Deployment,
) -> None:
    """Six long-prompt requests; the decode instance's worker is killed while some decode,
    some pull and some still prefill. Every request ends (an error naming the dead worker
    or the missing decode instance, or done if it finished first): none hangs. The prefill
    instance frees the KV it held for handoffs; the decode instance restarts empty."""
    long = [SYSTEM * 3 + q for q in PROMPTS]
    results: dict[int, object] = {}
    with Client(deployment.endpoint) as client:

        def run(i: int) -> None:
            try:
                results[i] = client.generate(long[i % 4], GREEDY, timeout=120)
            except (RequestError, EngineError) as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        time.sleep(1.5)
        os.kill(deployment.pids["decode1-worker-0"], signal.SIGKILL)
        for t in threads:
            t.join(180)
        assert len(results) == 6
        failed = [r for r in results.values() if isinstance(r, Exception)]
        assert failed, results
        assert all("decode" in str(e) or "KV" in str(e) for e in failed), failed
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(r["alive"] for r in client.stats()["replicas"]):
                break
            time.sleep(0.5)
        out = client.generate(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
        assert out.finish_reason == "length"
        assert _free(client) == [28, 28]
        assert client.stats()["replicas"][0]["num_parked"] == 0


def test_a_client_that_vanishes_mid_transfer_frees_both_sides(deployment: Deployment) -> None:
    client = Client(deployment.endpoint)
    streams = [client.stream(PROMPTS[i % 4], GREEDY) for i in range(4)]
    for s in streams[:2]:
        next(iter(s))  # two have their first token (handed off), two may not
    client.close()  # gone without a word: the frontend aborts its requests
    with Client(deployment.endpoint) as other:
        assert _free(other) == [28, 28]
