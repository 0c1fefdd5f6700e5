"""Data-parallel replicas over two machines: `sarazmq serve --dp 2 --nnodes 2` on loopback,
each node running one whole replica, the head's frontend reaching node 1's replica over
the node link (CurveZMQ keys).

The model is the tiny random Llama of tests/test_multinode.py; the reference is the same
model in one process. A kill -9 of node 1's worker takes only its replica down (the head's
keeps serving), and with `--restart on-failure` node 1 joins again and its replica takes
requests again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from proc_utils import sarazmq_children
from test_multinode import (
    TwoNodes,
    first_line,
    free_port_pair,
    keys,  # noqa: F401 - a fixture
    serve,
    stop,
    tiny_model,  # noqa: F401 - a fixture
)

from sarazmq import LLM
from sarazmq.client import EngineError, RequestError
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
# one thread per replica, one request at a time each: later requests wait (and can move)
DP = ["--dp", "2", "--router", "round-robin", "--tp", "1", "--max-num-seqs", "1"]
DP += ["--restart", "on-failure"]


@pytest.fixture(scope="module")
def replicas(tiny_model: str, keys: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:  # noqa: E501, F811  # fmt: skip
    endpoint = f"ipc://{tmp_path_factory.mktemp('ep')}/dp.ipc"
    port = free_port_pair()
    key = ["--curve-key-file", str(keys["secret"]), *DP]
    # the engine options of test_multinode with --tp 1 (the last --tp given wins)
    head = serve(tiny_model, port, 0, "--endpoint", endpoint, *key)
    node = serve(tiny_model, port, 1, *key)
    nodes = TwoNodes(head, node, endpoint, port, keys["public"])
    line = first_line(head, 120)
    assert "serving" in line and "2 replicas" in line, (line, stop(nodes))
    yield nodes
    stop(nodes)


def test_both_replicas_serve_the_single_engine_outputs(replicas: TwoNodes, tiny_model: str) -> None:  # noqa: E501, F811  # fmt: skip
    llm = LLM(model=tiny_model, dtype="float32", chunk_size=64, max_model_len=4096,
              num_kv_blocks=512, num_threads=1)  # fmt: skip
    reference = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}
    with replicas.client() as client:
        got = {p: client.generate(p, GREEDY).token_ids for p in PROMPTS}
        stats = client.stats()
    assert got == reference
    assert [r["alive"] for r in stats["replicas"]] == [True, True]
    sent = [r["num_sent"] for r in stats["frontend"]["router"]["instances"]]
    assert min(sent) >= 2, sent  # round-robin: node 1's replica served half
    nodes = {n["node"]: n for n in stats["nodes"]}
    assert nodes[0]["replicas"] == [0] and nodes[1]["replicas"] == [1]


def test_a_lost_node_takes_only_its_replica_down_and_it_comes_back(replicas: TwoNodes) -> None:
    """Six long requests, three per replica (one running, two waiting each); node 1's
    worker is killed: its running request fails, its two waiting ones finish on the
    head's replica, and node 1 joins again with its replica."""
    results: dict[int, object] = {}
    worker = next(
        pid for pid, cmd in sarazmq_children(replicas.node.pid).items() if "procs.worker" in cmd
    )
    with replicas.client() as client:

        def run(i: int) -> None:
            try:
                results[i] = client.generate(PROMPTS[0], LONG, timeout=120)
            except (RequestError, EngineError) as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # every request routed; the first of each replica streaming
        os.kill(worker, signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        failed = [r for r in results.values() if isinstance(r, Exception)]
        done = [r for r in results.values() if not isinstance(r, Exception)]
        assert len(results) == 6
        assert 1 <= len(failed) <= 3, results
        assert all("node 1" in str(e) for e in failed)
        assert all(len(o.token_ids) == LONG.max_tokens for o in done)  # type: ignore[attr-defined]
        assert client.stats()["frontend"]["num_rerouted"] >= 1
        # node 1 (restart on-failure) joins again; its replica takes requests again
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = client.stats()
            if all(r["alive"] for r in stats["replicas"]):
                break
            time.sleep(0.5)
        assert [r["alive"] for r in stats["replicas"]] == [True, True]
        before = stats["frontend"]["router"]["instances"][1]["num_sent"]
        for p in PROMPTS:
            assert client.generate(p, GREEDY).finish_reason == "length"
        after = client.stats()["frontend"]["router"]["instances"][1]["num_sent"]
        assert after - before == 2
    assert replicas.head.poll() is None and replicas.node.poll() is None
