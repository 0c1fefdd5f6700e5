"""Hostile and bad HTTP input: each gets its status and a message naming the problem, and a
normal request succeeds after it."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from http_fixtures import API_KEY, MAX_MODEL_LEN, HTTPServer

from sarazmq.client import Client

pytestmark = [pytest.mark.model]

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(http_server: HTTPServer) -> HTTPServer:
    return http_server  # shared by the HTTP modules (conftest.py)


@pytest.fixture
def http(server: HTTPServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c
    # after each case, a normal request still succeeds
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    return err


COMPLETION_CASES = [
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "Expected `int"),
    ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "max_tokens"),
    ({"prompt": [1, 10**30]}, "prompt", "token ids"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs", "logprobs"),
    ({"prompt": "hi", "n": 2}, "n", "n=2"),
    ({"prompt": "hi", "echo": True}, "echo", "echo"),
    ({"prompt": 12}, "prompt", ""),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 2, 10**9]}, "prompt", "token ids"),
    ({"prompt": "hello " * (2 * MAX_MODEL_LEN)}, "prompt", "context"),
    ({"max_tokens": 3}, "prompt", "missing"),
]


@pytest.mark.parametrize(("body", "param", "needle"), COMPLETION_CASES)
def test_bad_completion_parameters_are_400_naming_the_field(
    http: httpx.Client, body: dict, param: str, needle: str
) -> None:
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err
    assert needle in err["message"], err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param, err


def test_malformed_json_and_invalid_utf8(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    err = error_of(http.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers), 400)
    assert "JSON" in err["message"] and err["param"] is None
    bad = b'{"prompt": "\xff\xfe hi", "max_tokens": 2}'
    err = error_of(http.post("/v1/completions", content=bad, headers=headers), 400)
    assert "UTF-8" in err["message"] or "utf-8" in err["message"].lower()
    err = error_of(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)


def test_unknown_fields_are_accepted_and_ignored(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "frobnicate": {"x": 1}, "logit_bias": {}},
    )
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_and_unknown_route_too(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert err["param"] == "model" and "gpt-9" in err["message"]
    error_of(http.get("/v1/nothing"), 404)


def test_a_50_mib_body_is_413(http: httpx.Client) -> None:
    body = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'
    err = error_of(http.post("/v1/completions", content=body), 413)
    assert "larger than" in err["message"]


def test_api_key_wrong_or_missing_is_401(server: HTTPServer) -> None:
    with httpx.Client(base_url=server.root, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = anon.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            err = error_of(r, 401)
            assert "API key" in err["message"] and r.headers["www-authenticate"] == "Bearer"
        assert anon.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200  # probes need no key


def wait_idle(server: HTTPServer, timeout: float = 20.0) -> dict:
    with Client(server.deployment.endpoint) as c:
        deadline = time.monotonic() + timeout
        while True:
            stats = c.stats()
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
            if (idle and stats["num_free_blocks"] == stats["num_total_blocks"]) or (
                time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.1)


def test_200_concurrent_streams(server: HTTPServer) -> None:
    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(
            base_url=server.root, headers=AUTH, timeout=300, limits=limits
        ) as c:

            async def one(i: int) -> int:
                body = {"prompt": f"Count: {i},", "max_tokens": 6, "stream": True,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                chunks = 0
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1
                return chunks

            return await asyncio.gather(*(one(i) for i in range(200)))

    counts = asyncio.run(main())
    assert len(counts) == 200 and all(n >= 1 for n in counts)


def test_50_clients_disconnecting_mid_stream_free_the_pool(server: HTTPServer) -> None:
    async def main() -> None:
        async def one(i: int) -> None:
            async with httpx.AsyncClient(base_url=server.root, headers=AUTH, timeout=60) as c:
                body = {"prompt": f"Story {i}:", "max_tokens": 400, "stream": True,
                        "ignore_eos": True}  # fmt: skip
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return  # leave after the first chunk: the connection closes

        await asyncio.gather(*(one(i) for i in range(50)))

    asyncio.run(main())
    stats = wait_idle(server)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def _api_process(server: HTTPServer) -> psutil.Process:
    return psutil.Process(server.deployment.pids["api-0"])


def test_a_client_that_never_reads_has_bounded_memory(server: HTTPServer) -> None:
    proc = _api_process(server)
    rss0 = proc.memory_info().rss
    body = json.dumps({"prompt": "Go on:", "max_tokens": 400, "stream": True,
                       "ignore_eos": True, "logprobs": 5}).encode()  # fmt: skip
    port = int(server.root.rsplit(":", 1)[1])
    socks = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)
    try:
        # meanwhile the server keeps serving others
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert r.status_code == 200
        time.sleep(8)
        grown = proc.memory_info().rss - rss0
        assert grown < 64 << 20, f"api process grew {grown >> 20} MiB"
    finally:
        for s in socks:
            s.close()
    stats = wait_idle(server, 30)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_non_loopback_bind_without_key_is_refused() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sarazmq.cli",
            "api",
            "--connect",
            "ipc:///nonexistent",
            "--http-host",
            "0.0.0.0",
            "--port",
            "1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "without an API key" in lines[0], r.stderr
