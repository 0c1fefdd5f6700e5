"""Fault tolerance, bad input and transport security over real processes (issue 5).

One deployment of the default model serves every test of this module: a CurveZMQ tcp
endpoint on loopback, a small KV pool (64 blocks of 16 tokens), a 4 s client timeout,
its children's logs in a file. The overload test has a deployment of its own, the same
but for a tiny random-weight model: what it tests (preemption, exactly-once finishing,
bounded memory over a thousand requests) is the serving machinery's, not the model's. The process-fault tests (kill -9 of each kind, restart, SIGTERM drain) are in
tests/test_process_faults.py. Numbers the tests measure are printed (pytest -s).
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarazmq.client import AsyncClient, Client, EngineError, RequestError
from sarazmq.config import (
    DEFAULT_MODEL,
    CacheConfig,
    CurveKeys,
    DeploymentConfig,
    EngineConfig,
    SchedulerConfig,
)
from sarazmq.keys import create_keypair, load_keypair, load_public_key
from sarazmq.model.tiny import write_tiny_llama
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment
from sarazmq.protocol.client import (
    MAX_CLIENT_FRAME_BYTES,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ProtocolError,
    ServerMessage,
)
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model]

NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
CLIENT_TIMEOUT_S = 4.0
enc = msgspec.msgpack.Encoder()
server_decoder = msgspec.msgpack.Decoder(ServerMessage)


def vm_kib(pid: int, field: str = "VmRSS") -> int:
    """VmRSS / VmHWM of a process in KiB, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Env:
    """The module's deployment and how to reach it."""

    def __init__(self, dep: Deployment, public_key: bytes, log_file: Path) -> None:
        self.dep = dep
        self.endpoint = dep.endpoint
        self.public_key = public_key
        self.log_file = log_file
        self.ctx = zmq.Context()

    def client(self, **kw: object) -> Client:
        return Client(self.endpoint, curve_server_key=self.public_key, **kw)

    def async_client(self, **kw: object) -> AsyncClient:
        return AsyncClient(self.endpoint, curve_server_key=self.public_key, **kw)

    def dealer(self, rcvhwm: int = 1000) -> zmq.Socket:
        """A raw DEALER that speaks CurveZMQ with the server's key (a hostile client)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = self.public_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.connect(self.endpoint)
        return sock

    def pid(self, name: str) -> int:
        return self.dep.pids[name]

    def stats(self) -> dict:
        with self.client() as c:
            return c.stats()

    def wait_pool_full(self, timeout: float) -> float:
        """Seconds until no request is waiting/running and every KV block is free."""
        t0 = time.monotonic()
        with self.client() as c:
            while True:
                s = c.stats()
                idle = s["num_running"] == 0 and s["num_waiting"] == 0
                if idle and s["num_free_blocks"] == s["num_total_blocks"]:
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout:
                    raise AssertionError(f"pool not full again after {timeout} s: {s}")
                time.sleep(0.1)


def _start_env(tmp_path_factory: pytest.TempPathFactory, model: str) -> Iterator[Env]:
    """A deployment of `model` with this module's settings, and how to reach it."""
    keydir = tmp_path_factory.mktemp("keys")
    public_file, secret_file = create_keypair(keydir)
    public, secret = load_keypair(secret_file)
    log_file = tmp_path_factory.mktemp("logs") / "deployment.log"
    config = EngineConfig(
        model=model,
        num_threads=1,
        dtype="float32",
        scheduler=SchedulerConfig(
            policy="sarathi", chunk_size=256, max_num_seqs=64, max_model_len=MAX_MODEL_LEN
        ),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
    )
    with Deployment(
        config,
        DeploymentConfig(
            endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            curve=CurveKeys(public=public.decode(), secret=secret.decode()),
            client_timeout=CLIENT_TIMEOUT_S,
            log_file=str(log_file),
            drain_timeout=5.0,
        ),
    ) as dep:
        e = Env(dep, load_public_key(public_file), log_file)
        yield e
        e.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from _start_env(tmp_path_factory, DEFAULT_MODEL)


@pytest.fixture
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The module's deployment with a tiny random Llama (the default model's tokenizer):
    a thousand requests cost the processes' own work, not ~100 s of 135M-model compute.
    Function-scoped: its processes go as soon as the one test using it ends."""
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    yield from _start_env(tmp_path_factory, model)


def recv_one(sock: zmq.Socket, timeout_s: float = 10.0) -> ServerMessage:
    """The next non-heartbeat message (heartbeats are answered, as a client must), or
    AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            raise AssertionError(f"no reply within {timeout_s} s")
        msg = server_decoder.decode(sock.recv())
        if not isinstance(msg, Heartbeat):
            return msg
        sock.send(enc.encode(Pong(time=msg.time)))


# ---- 1. hostile frames ---------------------------------------------------------------

PICKLE_MARKER = Path("/tmp/sarazmq-pickle-was-executed")
# protocol-0 pickle of os.system("touch MARKER"): runs the command if anyone unpickles it
PICKLE_PAYLOAD = f"cos\nsystem\n(S'touch {PICKLE_MARKER}'\ntR.".encode()

HOSTILE: list[tuple[str, list[bytes], type, str]] = [
    # (case, frames, expected reply type, expected request id of the reply or "")
    ("garbage bytes", [b"\xff\xfe\x00 garbage \xc1"], ProtocolError, ""),
    ("not msgpack at all", [b"GET / HTTP/1.1\r\n\r\n"], ProtocolError, ""),
    (
        "truncated msgpack",
        [enc.encode(GenerateRequest("t1", prompt="hello"))[:-3]],
        ProtocolError,
        "",
    ),
    ("pickle payload", [PICKLE_PAYLOAD], ProtocolError, ""),
    ("msgpack array", [enc.encode([1, 2, 3])], ProtocolError, ""),
    ("msgpack scalar", [enc.encode(42)], ProtocolError, ""),
    ("unknown kind, no id", [enc.encode({"type": "exec", "cmd": "rm -rf /"})], ProtocolError, ""),
    ("unknown kind", [enc.encode({"type": "exec", "request_id": "u1"})], OutputDelta, "u1"),
    (
        "wrong type: prompt",
        [enc.encode({"type": "generate", "request_id": "w1", "prompt": 123})],
        OutputDelta,
        "w1",
    ),
    (
        "wrong type: request_id",
        [enc.encode({"type": "generate", "request_id": 5, "prompt": "x"})],
        ProtocolError,
        "",
    ),
    (
        "wrong type: params",
        [enc.encode({"type": "generate", "request_id": "w2", "prompt": "x", "params": [1]})],
        OutputDelta,
        "w2",
    ),
    ("nested 100k deep", [b"\x91" * 100_000], ProtocolError, ""),
    ("array claiming 4G items", [b"\xdd\xff\xff\xff\xff"], ProtocolError, ""),
    ("1 MiB of random bytes", [random.Random(0).randbytes(1 << 20)], ProtocolError, ""),
    ("two frames", [b"a", enc.encode(GenerateRequest("m1", prompt="x"))], ProtocolError, ""),
    ("three frames", [b"", b"", b""], ProtocolError, ""),
]


def test_hostile_frames_are_rejected_and_logged_once(env: Env) -> None:
    PICKLE_MARKER.unlink(missing_ok=True)
    sock = env.dealer()
    latencies: list[float] = []
    try:
        for _round in range(2):  # twice: the second time nothing new is logged
            for case, frames, want, rid in HOSTILE:
                t0 = time.monotonic()
                sock.send_multipart(frames)
                reply = recv_one(sock)
                latencies.append(time.monotonic() - t0)
                assert isinstance(reply, want), (case, reply)
                if isinstance(reply, OutputDelta):
                    assert reply.request_id == rid and reply.finish_reason == "error", case
                    assert reply.error, case
    finally:
        sock.close()
    assert not PICKLE_MARKER.exists(), "a pickle payload was executed"
    with env.client() as c:
        out = c.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
        stats = c.stats()
    assert out.finish_reason in ("stop", "length")
    rejected = stats["frontend"]["rejected"]
    single = sum(len(frames) == 1 for _, frames, _, _ in HOSTILE)
    assert rejected["undecodable"] + rejected["invalid"] >= 2 * single, rejected
    assert rejected["multipart"] >= 2 * (len(HOSTILE) - single), rejected
    log = env.log_file.read_text()
    for kind in ("undecodable", "invalid", "multipart"):
        assert rejected[kind] >= 2
        assert log.count(f"rejected a client message ({kind})") == 1, (kind, log[-3000:])
    print(
        f"\nhostile frames: {2 * len(HOSTILE)} sent, all answered; reply latency "
        f"max {max(latencies) * 1000:.1f} ms; rejected counters {rejected}"
    )


def test_oversized_frame_drops_only_that_connection(env: Env) -> None:
    fe = env.pid("frontend-0")
    rss0 = vm_kib(fe)
    sock = env.dealer()
    try:
        sock.send(b"\x00" * (MAX_CLIENT_FRAME_BYTES + 1024 * 1024))
        # the transport drops the connection on the frame's size header; nothing comes back
        assert not sock.poll(2000)
    finally:
        sock.close()
    with env.client() as c:
        assert c.generate("Hi", SamplingParams(temperature=0, max_tokens=1)).finish_reason
    grew = vm_kib(fe) - rss0
    assert grew < 8 * 1024, f"frontend grew {grew} KiB on a refused 17 MiB frame"
    assert env.dep.pids["frontend-0"] == fe and env.dep.failure == ""
    print(f"\noversized frame: connection dropped, frontend RSS +{grew} KiB")


def _frame_strategy() -> st.SearchStrategy[list[bytes]]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )
    kinds = st.sampled_from(["generate", "abort", "stats", "pong", "delta", "", "x" * 300])
    params = st.one_of(
        st.dictionaries(
            st.sampled_from(
                ["temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "logprobs", "x"]
            ),
            values,
            max_size=3,
        ),
        values,
    )
    near_valid = st.fixed_dictionaries(
        {"type": kinds},
        optional={
            "request_id": st.one_of(st.text(max_size=12), values),
            "prompt": st.one_of(st.text(max_size=12), values),
            "prompt_token_ids": st.one_of(
                st.lists(st.integers(min_value=-5, max_value=60_000), max_size=6), values
            ),
            "messages": values,
            "params": params,
            "iterations_from": values,
        },
    ).map(enc.encode)
    one = st.one_of(
        st.binary(max_size=200),
        values.map(enc.encode),
        near_valid,
        near_valid.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
    )
    return st.one_of(one.map(lambda f: [f]), st.lists(one, min_size=2, max_size=3))


def _drain(sock: zmq.Socket, replies: Counter[str]) -> None:
    while sock.poll(0):
        msg = server_decoder.decode(sock.recv())
        replies[type(msg).__name__] += 1


def test_thousands_of_generated_frames_then_a_normal_request(env: Env) -> None:
    """Hypothesis frames (garbage, random msgpack, near-valid requests, truncations,
    multipart); then a normal request succeeds and no process grew without bound."""
    pids = {name: pid for name, pid in env.dep.pids.items()}
    rss0 = {name: vm_kib(pid) for name, pid in pids.items()}
    sock = env.dealer()
    sent = Counter[str]()
    replies = Counter[str]()

    @settings(
        max_examples=3000,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(frames=_frame_strategy())
    def send(frames: list[bytes]) -> None:
        # no valid request may start a long generation: cap what a lucky one can cost
        sock.send_multipart(frames)
        sent["multipart" if len(frames) > 1 else "single"] += 1
        _drain(sock, replies)

    t0 = time.monotonic()
    try:
        send()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sock.poll(1000):
            _drain(sock, replies)
    finally:
        sock.close()
    elapsed = time.monotonic() - t0
    with env.client() as c:
        out = c.generate("Hello there", SamplingParams(temperature=0, max_tokens=3))
        assert out.finish_reason in ("stop", "length") and out.token_ids
        stats = c.stats()
    env.wait_pool_full(60)
    grew = {name: vm_kib(pid) - rss0[name] for name, pid in pids.items()}
    total = sum(sent.values())
    assert total >= 2500
    assert env.dep.pids == pids and env.dep.failure == ""  # nothing died or restarted
    # every multipart message was answered, and so was nearly every single frame (an empty
    # frame reads as "I am leaving", an abort/pong gets no answer)
    assert replies["ProtocolError"] >= sent["multipart"]
    # bound: no process gained more than 64 MiB over thousands of hostile frames
    for name, kib in grew.items():
        assert kib < 64 * 1024, (name, grew)
    print(
        f"\nhypothesis: {total} messages ({dict(sent)}) in {elapsed:.1f} s; replies "
        f"{dict(replies)}; RSS growth KiB {grew}; frontend counters {stats['frontend']}"
    )


# ---- 2. bad requests ------------------------------------------------------------------

BAD_PARAMS = [
    ({"temperature": -1.0}, "params.temperature"),
    ({"temperature": float("nan")}, "params.temperature"),
    ({"temperature": "hot"}, "params.temperature"),
    ({"top_p": 0.0}, "params.top_p"),
    ({"top_p": 1.5}, "params.top_p"),
    ({"top_k": 0}, "params.top_k"),
    ({"min_p": 2.0}, "params.min_p"),
    ({"max_tokens": 0}, "params.max_tokens"),
    ({"max_tokens": -5}, "params.max_tokens"),
    ({"min_tokens": 50, "max_tokens": 10}, "params.min_tokens"),
    ({"seed": -1}, "params.seed"),
    ({"stop": [""]}, "params.stop"),
    ({"stop_token_ids": [-3]}, "params.stop_token_ids"),
    ({"repetition_penalty": 0.0}, "params.repetition_penalty"),
    ({"presence_penalty": 9.0}, "params.presence_penalty"),
    ({"frequency_penalty": -9.0}, "params.frequency_penalty"),
    ({"logprobs": 99}, "params.logprobs"),
    ({"best_of": 4}, "params.best_of"),  # unknown field
    ({"seed": 2**64 - 1}, "params.seed"),
]


def test_bad_requests_get_structured_errors_naming_the_field(env: Env) -> None:
    sock = env.dealer()
    cases: list[tuple[dict, str]] = [
        ({"prompt": "hi", "params": p}, field) for p, field in BAD_PARAMS
    ] + [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(1, MAX_MODEL_LEN + 50))}, "prompt_token_ids"),
        ({"prompt": "hello " * (2 * MAX_MODEL_LEN)}, "prompt"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
        ({"prompt": "hi", "priority": 1}, "priority"),  # unknown top-level field
    ]
    latencies = []
    try:
        for i, (body, field) in enumerate(cases):
            rid = f"bad{i}"
            t0 = time.monotonic()
            sock.send(enc.encode({"type": "generate", "request_id": rid, **body}))
            reply = recv_one(sock, 10.0)
            latencies.append(time.monotonic() - t0)
            assert isinstance(reply, OutputDelta), (body, reply)
            assert reply.request_id == rid and reply.finish_reason == "error", (body, reply)
            assert reply.error_field == field, (body, reply.error_field, reply.error)
    finally:
        sock.close()
    # through the SDK: RequestError with .field, and the connection keeps working
    with env.client() as c:
        with pytest.raises(RequestError) as e:
            c.generate("", SamplingParams(max_tokens=2))
        assert e.value.field == "prompt"
        with pytest.raises(RequestError, match="context") as e:
            c.generate(list(range(1, 400)), SamplingParams(max_tokens=2))
        assert e.value.field == "prompt_token_ids"
        # max_tokens beyond the context is clamped, not an error
        prompt = list(range(1000, 1000 + MAX_MODEL_LEN - 6))
        out = c.generate(prompt, SamplingParams(temperature=0, max_tokens=10_000), timeout=300)
        assert out.finish_reason in ("stop", "length")
        assert 1 <= len(out.token_ids) <= 6
    print(
        f"\nbad requests: {len(cases)} cases, each a named error in "
        f"max {max(latencies) * 1000:.1f} ms"
    )


# ---- 3. overload ------------------------------------------------------------------------


def test_thousand_requests_against_a_small_pool(tiny_env: Env) -> None:
    env = tiny_env
    # 15-token prompts fill their first block; their second decode needs a second block, held
    # for the rest of their 8 tokens: with ~63 admitted at once the pool must preempt
    # (with 4 tokens after 14, fast steps could finish requests before the pool filled)
    # (the tiny model's steps are fast, yet a thousand arrive faster: ~260 preemptions)
    n, max_tokens, prompt_len = 1000, 8, 15
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_len)] for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pids = dict(env.dep.pids)
    base = {name: vm_kib(pid) for name, pid in pids.items()}
    peak = dict(base)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for name, pid in pids.items():
                peak[name] = max(peak[name], vm_kib(pid))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    s0 = env.stats()

    async def run() -> list:
        async with env.async_client(heartbeat_timeout=30) as c:
            return await asyncio.gather(
                *(
                    c.generate(prompts[i % 10], params, request_id=f"ov{i}", timeout=900)
                    for i in range(n)
                ),
                return_exceptions=True,
            )

    t0 = time.monotonic()
    try:
        outs = asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
    elapsed = time.monotonic() - t0
    s1 = env.stats()
    errors = [o for o in outs if isinstance(o, BaseException)]
    assert errors == [], errors[:3]
    assert sorted(o.request_id for o in outs) == sorted(f"ov{i}" for i in range(n))
    assert all(o.finish_reason == "length" for o in outs)
    assert all(len(o.token_ids) == max_tokens == len(o.token_times) for o in outs)
    assert all(o.prompt_token_ids == prompts[i % 10] for i, o in enumerate(outs))
    # the scheduler finished each exactly once, and had to preempt to get through
    assert s1["num_finished"] - s0["num_finished"] == n
    assert s1["num_preemptions"] > s0["num_preemptions"]
    assert s1["num_free_blocks"] == s1["num_total_blocks"] == NUM_BLOCKS
    # greedy: the same prompt gives the same tokens whatever the batch or preemptions
    by_prompt: dict[int, set[tuple[int, ...]]] = {}
    for i, o in enumerate(outs):
        by_prompt.setdefault(i % 10, set()).add(tuple(o.token_ids))
    assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
    grew = {name: peak[name] - base[name] for name in pids}
    for name, kib in grew.items():
        assert kib < 256 * 1024, (name, grew)
    print(
        f"\noverload: {n} requests in {elapsed:.1f} s, {s1['num_iterations'] - s0['num_iterations']}"
        f" iterations, {s1['num_preemptions'] - s0['num_preemptions']} preemptions, max "
        f"{max(o.num_preemptions for o in outs)} per request; peak RSS MiB "
        f"{ {k: round(v / 1024) for k, v in peak.items()} }; growth KiB {grew}"
    )


# ---- 4. clients that go away ------------------------------------------------------------

# "Count:" is 3 tokens: 240 more fill the 256-token context (16 blocks of the 64)
LONG = {"temperature": 0, "max_tokens": 240, "ignore_eos": True}


def _start_long_requests(sock: zmq.Socket, tag: str, k: int = 4) -> None:
    for i in range(k):
        sock.send(
            enc.encode(
                {"type": "generate", "request_id": f"{tag}{i}", "prompt": "Count:", "params": LONG}
            )
        )


def test_client_that_disconnects_mid_stream_is_aborted(env: Env) -> None:
    gone0 = env.stats()["frontend"]["clients_gone"].get("disconnected", 0)
    sock = env.dealer()
    _start_long_requests(sock, "dc")
    got = 0
    while got < 8:  # mid-stream: every request has produced tokens
        msg = recv_one(sock, 120)
        if isinstance(msg, OutputDelta):
            assert not msg.finish_reason, msg
            got += 1
    sock.close(linger=0)
    freed_after = env.wait_pool_full(10)
    s = env.stats()
    assert s["frontend"]["clients_gone"].get("disconnected", 0) == gone0 + 1
    print(f"\ndisconnect mid-stream: 4 requests aborted, pool full again {freed_after:.2f} s later")


def test_client_that_stops_reading_is_aborted(env: Env) -> None:
    s0 = env.stats()["frontend"]
    sock = env.dealer(rcvhwm=1)
    # The requests must outlive the client timeout, whatever the decode speed: 8 of them
    # need 128 KV blocks at their end and the pool has 64, so they run in two waves at
    # least (preempted and recomputed), ~500 decode steps: the four requests of 200 tokens
    # this test used to send could all finish before the timeout once decode got faster
    k = 8
    try:
        _start_long_requests(sock, "sr", k)
        t0 = time.monotonic()
        # never reads, never answers a heartbeat
        with env.client() as c:
            while c.stats()["num_running"] == 0:
                assert time.monotonic() - t0 < 60
                time.sleep(0.1)
        env.wait_pool_full(CLIENT_TIMEOUT_S + 30)
        freed_after = time.monotonic() - t0
    finally:
        sock.close(linger=0)
    s1 = env.stats()["frontend"]
    assert s1["num_aborted_for_gone_clients"] - s0["num_aborted_for_gone_clients"] == k
    assert sum(s1["clients_gone"].values()) == sum(s0["clients_gone"].values()) + 1
    assert freed_after < CLIENT_TIMEOUT_S + 10
    print(
        f"\nclient stops reading: aborted and pool full {freed_after:.1f} s after it sent "
        f"(client timeout {CLIENT_TIMEOUT_S} s); reasons {s1['clients_gone']}"
    )


# ---- 6. health ------------------------------------------------------------------------


def test_health_api_and_command(env: Env, tmp_path: Path) -> None:
    with env.client() as c:
        report = c.health(timeout=30)
    assert report.healthy and report.reason == "" and report.stats["num_total_blocks"]

    async def ahealth() -> bool:
        async with env.async_client() as c:
            return (await c.health(timeout=30)).healthy

    assert asyncio.run(ahealth())
    keyfile = tmp_path / "server.key"
    keyfile.write_bytes(b'curve\n    public-key = "' + env.public_key + b'"\n')
    cmd = [sys.executable, "-m", "sarazmq.cli", "health"]
    ok = subprocess.run(
        [*cmd, env.endpoint, "--curve-server-key-file", str(keyfile), "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("healthy"), ok.stdout + ok.stderr
    t0 = time.monotonic()
    bad = subprocess.run(
        [*cmd, f"ipc://{tmp_path}/nobody.ipc", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and bad.stdout.startswith("unhealthy"), bad.stdout + bad.stderr
    no_key = subprocess.run(
        [*cmd, env.endpoint, "--timeout", "3"], capture_output=True, text=True, timeout=120
    )
    assert no_key.returncode == 1 and "unhealthy" in no_key.stdout
    print(f"\nhealth: {ok.stdout.strip()}; dead endpoint: {bad.stdout.strip()}")
    print(f"(dead endpoint command took {time.monotonic() - t0:.1f} s)")


# ---- 7. transport security ------------------------------------------------------------


def test_client_without_the_server_key_gets_nothing_through(env: Env) -> None:
    with env.client() as good:
        f0 = good.stats()["frontend"]
        attempts = {
            "no key": Client(env.endpoint, heartbeat_timeout=2.0),
            "wrong server key": Client(
                env.endpoint, curve_server_key=zmq.curve_keypair()[0], heartbeat_timeout=2.0
            ),
        }
        for what, bad in attempts.items():
            t0 = time.monotonic()
            with bad, pytest.raises(EngineError, match="handshake|unreachable|lost") as e:
                bad.generate("Hello", SamplingParams(max_tokens=2))
            took = time.monotonic() - t0
            assert took < 5, (what, took)
            print(f"\n{what}: EngineError after {took:.2f} s: {e.value}")
        f1 = good.stats()["frontend"]
    # the server saw exactly one frame meanwhile (besides heartbeat answers): the good
    # client's second stats request
    assert (f1["num_frames"] - f1["num_pongs"]) - (f0["num_frames"] - f0["num_pongs"]) == 1
    assert f1["num_accepted"] == f0["num_accepted"]


def test_ipc_is_private_and_public_tcp_needs_keys(tmp_path: Path) -> None:
    keydir = tmp_path / "k"
    result = subprocess.run(
        [sys.executable, "-m", "sarazmq.cli", "keys", str(keydir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    public_file, secret_file = keydir / "server.key", keydir / "server.key_secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert "secret" not in public_file.read_text().split("curve", 1)[1]
    public, secret = load_keypair(secret_file)
    assert load_public_key(public_file) == public and zmq.curve_public(secret) == public
    again = subprocess.run(
        [sys.executable, "-m", "sarazmq.cli", "keys", str(keydir)], capture_output=True, text=True
    )
    assert again.returncode != 0 and "not overwriting" in again.stderr
    # serve refuses a non-loopback tcp endpoint without keys, before loading anything
    port = free_tcp_port()
    refused = subprocess.run(
        [sys.executable, "-m", "sarazmq.cli", "serve", "--endpoint", f"tcp://0.0.0.0:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "CurveZMQ" in refused.stderr
    # a secret key others can read is refused too
    os.chmod(secret_file, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_keypair(secret_file)
