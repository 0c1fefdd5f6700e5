"""The OpenAI-compatible HTTP server through the real `openai` package, on the real model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from http_fixtures import API_KEY, MODEL, HTTPServer

from sarazmq import LLM, SamplingParams

pytestmark = [pytest.mark.model]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ],
]


@pytest.fixture(scope="module")
def server(http_server: HTTPServer) -> HTTPServer:
    return http_server  # shared by the HTTP modules (conftest.py)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        chunk_size=64, max_model_len=512, num_kv_blocks=256, dtype="float32", gguf_matmul="float"
    )


@pytest.fixture(scope="module")
def client(server: HTTPServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def test_completions_equal_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    for prompt, ref in zip(PROMPTS, expected):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.model == MODEL


def test_completion_streaming_matches_and_reports_usage(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16))
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[3],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_and_batches(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    (ref,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert one.choices[0].text == ref.text
    many = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert all(c.text == ref.text for c in many.choices)
    texts = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    refs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))
    assert [c.text for c in texts.choices] == [r.text for r in refs]
    assert texts.usage.completion_tokens == sum(len(r.token_ids) for r in refs)


def test_chat_equals_llm_chat_streaming_or_not(client: openai.OpenAI, llm: LLM) -> None:
    refs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=16))
    for messages, ref in zip(CHATS, refs):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0
        )
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.usage.completion_tokens == len(ref.token_ids)
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_async_client_concurrent_streams(server: HTTPServer, llm: LLM) -> None:
    refs = {p: r.text for p, r in zip(PROMPTS, llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10)))}  # fmt: skip

    async def main() -> list[tuple[str, str]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)

        async def one(p: str) -> tuple[str, str]:
            text = ""
            stream = await aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=10, temperature=0, stream=True
            )
            async for c in stream:
                text += c.choices[0].text if c.choices else ""
            return p, text

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS * 4))
        finally:
            await aclient.close()

    for p, text in asyncio.run(main()):
        assert text == refs[p]


def test_logprobs_completions_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the sampled token is the top
        assert tok in top
    c = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


def test_stop_strings_cut_the_text(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24))
    words = ref.text.split()
    assert len(words) > 3, ref.text
    stop = words[2]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == ref.text[: ref.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_version_health_metrics(server: HTTPServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with server.client() as http:
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        text = http.get("/metrics").text
    for name in (
        "sarazmq:num_requests_running",
        "sarazmq:num_requests_waiting",
        "sarazmq:kv_cache_usage_perc",
        "sarazmq:prompt_tokens_total",
        "sarazmq:generation_tokens_total",
        "sarazmq:num_preemptions_total",
        "sarazmq:prefix_cache_queries_total",
        "sarazmq:prefix_cache_hits_total",
        "sarazmq:time_to_first_token_seconds_bucket",
        "sarazmq:inter_token_latency_seconds_bucket",
        "sarazmq:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    count = next(
        line for line in text.splitlines()
        if line.startswith("sarazmq:e2e_request_latency_seconds_count")
    )  # fmt: skip
    assert float(count.split()[-1]) >= 1
    with httpx.Client(base_url=server.root, timeout=60) as http:
        # a second scrape sees the iterations run in between
        http.get("/metrics")
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        text = http.get("/metrics").text
    assert "sarazmq:iteration_tokens_total_count" in text


def test_replay_through_the_openai_api_and_replay_diff(server: HTTPServer, tmp_path) -> None:
    """The same workload replayed through HTTP (client timestamps) and through ZeroMQ
    (server timestamps), then compared by `replay-diff`."""
    from click.testing import CliRunner

    from sarazmq.cli import main

    workload = ["replay", "fixed", "--max-requests", "6", "--input-tokens", "24",
                "--output-tokens", "6", "--arrivals", "all_at_once", "--no-progress",
                "--vocab-size", "1000", "--avoid-ids", "0-16"]  # fmt: skip
    http_dir, zmq_dir = tmp_path / "http", tmp_path / "zmq"
    r = CliRunner().invoke(main, [*workload, "--openai-url", server.base_url,
                                  "--openai-api-key", API_KEY, "--output-dir", str(http_dir)])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(
        main, [*workload, "--connect", server.deployment.endpoint, "--output-dir", str(zmq_dir)]
    )
    assert r.exit_code == 0, r.output
    import json

    http_summary = json.loads((http_dir / "summary.json").read_text())
    assert http_summary["num_completed"] == 6 and http_summary["num_errors"] == 0
    assert http_summary["tbt_s"]["count"] == 6 * 5  # one SSE chunk per token
    # what only the engine knows is missing, not estimated
    assert http_summary["scheduling_delay_s"]["count"] == 0
    assert http_summary["iterations"]["count"] == 0
    assert http_summary["settings"]["timestamps"] == "client"
    r = CliRunner().invoke(
        main, ["replay-diff", str(http_dir), str(zmq_dir), "--name", "http", "--name", "zmq"]
    )
    assert r.exit_code == 0, r.output
    assert "http/zmq" in r.output
    assert (http_dir / "diff" / "comparison.json").is_file()
    assert (http_dir / "diff" / "compare_tbt_cdf.png").stat().st_size > 0


def test_standalone_api_command_serves_a_running_deployment(server: HTTPServer) -> None:
    """`sarazmq api --connect EP` is a second HTTP face for the same deployment."""
    import subprocess
    import sys
    import time

    from sarazmq.procs.endpoints import free_tcp_port

    port = free_tcp_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sarazmq.cli",
            "api",
            "--connect",
            server.deployment.endpoint,
            "--port",
            str(port),
            "--max-model-len",
            "512",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert f"http://127.0.0.1:{port}/v1" in line, line
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert [m.id for m in c.models.list().data] == [MODEL]
    finally:
        proc.terminate()
        t0 = time.monotonic()
        proc.wait(30)
        assert time.monotonic() - t0 < 30
