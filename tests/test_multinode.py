"""Multi-node deployments: two `sarazmq serve` launchers on loopback, node 0 (the head) and
node 1 (only its workers), tensor parallelism across them, joined with CurveZMQ keys.

The model is a tiny random Llama (8 heads, 4 KV heads, so tp 2 and tp 4 both fit) with
the default model's tokenizer and chat template: what is tested is the deployment, and
the reference is the same model served by one node with the same tp, so the outputs
must be identical.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pexpect
import pytest
from proc_utils import alive, sarazmq_children

from sarazmq.client import Client, EngineError
from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig, SchedulerConfig
from sarazmq.keys import create_keypair, load_public_key
from sarazmq.model.tiny import write_tiny_llama
from sarazmq.procs.endpoints import check_multinode, node_ranks
from sarazmq.procs.launcher import Deployment
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CHAT = "Tell me about the sea."
CHAT_TOKENS = 16
ENGINE = ["--tp", "2", "--threads", "1", "--chunk-size", "64", "--max-model-len", "4096"]
ENGINE += ["--num-kv-blocks", "512", "--log-level", "ERROR", "--dtype", "float32"]


def test_node_settings_are_checked() -> None:
    assert [list(node_ranks(4, 2, r)) for r in (0, 1)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="--nnodes 3 does not divide the deployment's 4"):
        node_ranks(4, 3, 0)
    with pytest.raises(ValueError, match=r"node_rank=2 must be in \[0, nnodes=2\)"):
        DeploymentConfig(nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="master_port=65535 must be in"):
        DeploymentConfig(nnodes=2, master_port=65535)
    remote = DeploymentConfig(nnodes=2, master_addr="10.0.0.1")
    with pytest.raises(ValueError, match="non-loopback --master-addr '10.0.0.1' without Curve"):
        check_multinode(EngineConfig(tensor_parallel_size=2), remote)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight Llama folder with the default model's tokenizer."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    public, secret = create_keypair(d, "server")
    _, other = create_keypair(d, "other")
    return {"public": public, "secret": secret, "other": other}


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[str, object]:
    """Greedy outputs of a single-node deployment with the same tp."""
    config = EngineConfig(
        model=tiny_model,
        tensor_parallel_size=2,
        num_threads=1,
        dtype="float32",  # outputs are compared across deployments
        scheduler=SchedulerConfig(chunk_size=64, max_model_len=4096),
        cache=CacheConfig(num_blocks=512),
    )
    with Deployment(config, DeploymentConfig()) as dep, Client(dep.endpoint) as client:
        ids = {p: client.generate(p, GREEDY).token_ids for p in PROMPTS}
        chat = SamplingParams(temperature=0, max_tokens=CHAT_TOKENS)
        reply = client.generate(None, chat, messages=[{"role": "user", "content": CHAT}]).text
    return {"ids": ids, "chat": reply}


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (torch's rendezvous, the node link)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


def serve(model: str, port: int, node_rank: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "sarazmq.cli", "serve", "--model", model, *ENGINE]
    cmd += ["--nnodes", "2", "--node-rank", str(node_rank), "--master-port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The process's first stdout line ("" if it exits or stays silent for `timeout`)."""
    out: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: out.put(proc.stdout.readline()), daemon=True).start()
    try:
        return out.get(timeout=timeout)
    except queue.Empty:
        return ""


@dataclass
class TwoNodes:
    head: subprocess.Popen[str]
    node: subprocess.Popen[str]
    endpoint: str
    port: int
    public: Path

    def client(self) -> Client:
        return Client(self.endpoint, curve_server_key=load_public_key(self.public))


def start_two_nodes(model: str, secret: Path, public: Path, endpoint: str, *extra: str) -> TwoNodes:
    """Node 0 (serving on `endpoint`) and node 1, both with `extra` options."""
    port = free_port_pair()
    key = ["--curve-key-file", str(secret), *extra]
    head = serve(model, port, 0, "--endpoint", endpoint, *key)
    node = serve(model, port, 1, *key)
    nodes = TwoNodes(head, node, endpoint, port, public)
    line = first_line(head, 120)
    assert "serving" in line and "over 2 nodes" in line, (line, stop(nodes))
    assert "joined the head" in first_line(node, 30)
    return nodes


def stop(nodes: TwoNodes) -> tuple[str, str]:
    """SIGTERM to the head, which stops node 1 (SIGTERM to node 1 only if it has not
    stopped 20 s later; SIGKILL after 60 s); returns both launchers' stderr."""
    errs = []
    for proc, grace in ((nodes.head, 0), (nodes.node, 20)):
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            errs.append(proc.communicate(timeout=60)[1])
        except subprocess.TimeoutExpired:
            proc.kill()
            errs.append(proc.communicate()[1])
    return errs[0], errs[1]


@pytest.fixture(scope="module")
def two_nodes(
    tiny_model: str, keys: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoNodes]:
    endpoint = f"ipc://{tmp_path_factory.mktemp('ep')}/two.ipc"
    nodes = start_two_nodes(tiny_model, keys["secret"], keys["public"], endpoint)
    yield nodes
    stop(nodes)


def test_sdk_outputs_equal_a_single_node(two_nodes: TwoNodes, reference: dict) -> None:
    got: dict[str, list[int]] = {}
    with two_nodes.client() as client:

        def run(p: str) -> None:
            got[p] = [t for d in client.stream(p, GREEDY) for t in d.token_ids]

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        nodes = client.stats()["nodes"]
    assert got == reference["ids"]
    assert [(n["node"], n["ranks"]) for n in nodes] == [(0, [0]), (1, [1])]


def test_chat_equals_a_single_node(two_nodes: TwoNodes, reference: dict) -> None:
    cmd = ["-m", "sarazmq.cli", "chat", "--connect", two_nodes.endpoint]
    cmd += ["--curve-server-key-file", str(two_nodes.public), "--max-tokens", str(CHAT_TOKENS)]
    child = pexpect.spawn(sys.executable, cmd, encoding="utf-8", timeout=60)
    try:
        child.expect("you> ")
        child.sendline(CHAT)
        child.expect("assistant> ")
        child.expect("\r\nyou> ")
        reply = child.before.replace("\r\n", "\n")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    assert reply == reference["chat"]


def test_health_lists_every_node(two_nodes: TwoNodes) -> None:
    cmd = [sys.executable, "-m", "sarazmq.cli", "health", two_nodes.endpoint]
    cmd += ["--curve-server-key-file", str(two_nodes.public)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("healthy")
    assert lines[1].strip().startswith("node 0 (head, 127.0.0.1): ranks [0], stages [0]")
    assert lines[2].strip().startswith("node 1 (")
    assert "ranks [1]" in lines[2] and "last heartbeat" in lines[2]


def test_wrong_key_or_world_size_is_refused(
    two_nodes: TwoNodes, tiny_model: str, keys: dict[str, Path]
) -> None:
    t0 = time.monotonic()
    wrong_key = serve(tiny_model, two_nodes.port, 1, "--curve-key-file", str(keys["other"]))
    no_key = serve(tiny_model, two_nodes.port, 1)
    key = ["--curve-key-file", str(keys["secret"])]
    wrong_size = serve(tiny_model, two_nodes.port, 1, *key, "--tp", "4")
    results = [p.communicate(timeout=60) for p in (wrong_key, no_key, wrong_size)]
    assert time.monotonic() - t0 < 45
    assert [p.returncode for p in (wrong_key, no_key, wrong_size)] == [1, 1, 1]
    for _, err in results[:2]:
        assert "CurveZMQ handshake with the head" in err and "Traceback" not in err, err
    err = results[2][1]
    assert "refused node 1: world size mismatch" in err and "Traceback" not in err, err
    assert "4 workers" in err and "the head 2" in err
    # the deployment did not notice
    with two_nodes.client() as client:
        assert client.generate(PROMPTS[0], GREEDY).token_ids  # still serves


def test_kill_node_worker_errors_every_request_and_both_exit(two_nodes: TwoNodes) -> None:
    """Last of the module's tests on `two_nodes`: it ends the deployment."""
    procs = sarazmq_children(two_nodes.head.pid) | sarazmq_children(two_nodes.node.pid)
    (victim,) = [pid for pid, cmd in sarazmq_children(two_nodes.node.pid).items()]
    assert "procs.worker" in procs[victim]
    errors: list[tuple[float, str]] = []
    started = [threading.Event() for _ in range(4)]
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    with two_nodes.client() as client:

        def run(i: int) -> None:
            try:
                for _ in client.stream(PROMPTS[i], long):
                    started[i].set()
            except EngineError as e:
                errors.append((time.monotonic(), str(e)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(60)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(15)
    assert len(errors) == 4
    assert max(t for t, _ in errors) - killed_at < 10
    reason = f"node 1 ({socket.gethostname()}) failed: worker-1 (pid {victim}) exited with signal 9"
    assert all(reason in e for _, e in errors), errors
    assert two_nodes.head.wait(20) == 1
    assert two_nodes.node.wait(20) == 1
    head_err, node_err = stop(two_nodes)
    assert f"sarazmq: {reason}" in head_err, head_err
    assert f"sarazmq: node 1: worker-1 (pid {victim}) exited with signal 9" in node_err, node_err
    deadline = time.monotonic() + 10
    while alive(list(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(list(procs)) == []


def test_pipeline_across_nodes_restarts_when_a_node_returns(
    tiny_model: str, keys: dict[str, Path], tmp_path: Path
) -> None:
    """pp 2 over 2 nodes (stage 1, which samples, on node 1), --restart on-failure on
    both: a hung node fails the requests; the head waits for the node to return; a dead
    head worker brings both back by themselves; SIGTERM to the head stops both (exit 0)."""
    from sarazmq import LLM

    llm = LLM(
        model=tiny_model, chunk_size=64, max_model_len=4096, num_kv_blocks=512, dtype="float32"
    )
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    del llm
    endpoint = f"ipc://{tmp_path}/restart.ipc"
    options = ("--tp", "1", "--pp", "2", "--restart", "on-failure")
    nodes = start_two_nodes(tiny_model, keys["secret"], keys["public"], endpoint, *options)
    try:
        old = sarazmq_children(nodes.node.pid)
        long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        with nodes.client() as client:
            assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == expected
            assert [n["stages"] for n in client.stats()["nodes"]] == [[0], [1]]
            stream = client.stream(PROMPTS[0], long)
            next(stream)
            # node 1 hangs (as if cut off): its workers live on, its agent says nothing
            nodes.node.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            with pytest.raises(EngineError, match=r"node 1 \(.*\) lost: no heartbeat for 5"):
                for _ in stream:
                    pass
            assert time.monotonic() - stopped_at < 10
            # then it is gone for good (its workers die with it)
            nodes.node.kill()
            nodes.node.wait()
            time.sleep(1)
            assert nodes.head.poll() is None  # the head waits for the node
            key = ("--curve-key-file", str(keys["secret"]))
            nodes.node = serve(tiny_model, nodes.port, 1, *key, *options)
            assert "joined the head" in first_line(nodes.node, 60)
            deadline = time.monotonic() + 60
            while not client.health(5).healthy and time.monotonic() < deadline:
                time.sleep(0.5)
            assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == expected
            assert alive(list(old)) == []
            # a head worker dies: the head restarts, node 1 joins again by itself
            old = sarazmq_children(nodes.node.pid)
            (worker0,) = [p for p, c in sarazmq_children(nodes.head.pid).items() if "worker" in c]
            os.kill(worker0, signal.SIGKILL)
            time.sleep(1)
            deadline = time.monotonic() + 60
            while not client.health(5).healthy and time.monotonic() < deadline:
                time.sleep(0.5)
            assert [client.generate(p, GREEDY).token_ids for p in PROMPTS] == expected
        assert alive(list(old)) == []
        procs = sarazmq_children(nodes.head.pid) | sarazmq_children(nodes.node.pid)
        head_err, node_err = stop(nodes)
        assert (nodes.head.returncode, nodes.node.returncode) == (0, 0), (head_err, node_err)
        assert alive(list(procs)) == []
    finally:
        stop(nodes)
