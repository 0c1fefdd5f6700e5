"""Replaying a workload through any OpenAI-compatible server (ours over HTTP, vLLM, ...).

Each request is a streamed `/v1/completions` call with the prompt as token ids,
`ignore_eos` and `max_tokens` = its output length, as `vllm bench serve` sends them. Times
are the client's: each token time is when the first byte of its SSE chunk arrived (one
chunk per token on vLLM and on sarazmq), the output length is the final usage chunk's.
What only the engine knows (server arrival, first scheduled, preemptions, iterations) is
missing for such a run, never estimated: those fields stay empty and the summary says
"timestamps": "client".
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from sarazmq.replay.driver import (
    WARMUP_OUTPUT_TOKENS,
    ReplayOutcome,
    drive,
    warmup_prompt,
)
from sarazmq.replay.metrics import RequestRecord
from sarazmq.replay.workload import WorkloadRequest


def completion_body(
    model: str, prompt: list[int], max_tokens: int, temperature: float, seed: int | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        body["seed"] = seed
    return body


async def _one_request(
    http: httpx.AsyncClient,
    req: WorkloadRequest,
    prompt: list[int],
    body: dict[str, Any],
    timeout: float | None,
) -> RequestRecord:
    """Streams one completion and records the client-side time of each chunk."""
    chunk_times: list[float] = []
    num_tokens = 0
    finish_reason: str | None = None
    error = ""
    sent = time.monotonic()
    try:
        async with http.stream("POST", "/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                if chunk.get("choices"):
                    chunk_times.append(now)
                    choice = chunk["choices"][0]
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    num_tokens = int(chunk["usage"]["completion_tokens"])
    except Exception as e:  # noqa: BLE001 - every failure is recorded, not raised
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not error and finish_reason is None:
        error = "stream ended without a finish reason"
    if not error and not num_tokens:
        num_tokens = len(chunk_times)
    return RequestRecord(
        request_id=req.request_id,
        arrival_s=sent,
        server_arrival_s=None,
        first_scheduled_s=None,
        token_times_s=chunk_times if not error else [],
        num_prompt_tokens=len(prompt),
        num_output_tokens=num_tokens,
        finish_reason=finish_reason,
        error=error,
        client_token_times_s=chunk_times if not error else None,
    )


async def replay_openai(
    base_url: str,
    model: str,
    requests: Sequence[WorkloadRequest],
    *,
    api_key: str | None = None,
    progress: bool = True,
    concurrency_limit: int | None = None,
    temperature: float = 0.0,
    seed: int | None = 0,
    timeout: float | None = None,
    warmup: bool = True,
    description: str = "replay",
) -> ReplayOutcome:
    """Replays `requests` against the OpenAI API at `base_url` (ending in /v1)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, limits=limits, timeout=None
    ) as http:
        if warmup and requests:
            body = completion_body(
                model, warmup_prompt(requests[0]), WARMUP_OUTPUT_TOKENS, 0.0, None
            )
            rec = await _one_request(http, requests[0], body["prompt"], body, timeout)
            if rec.error:
                raise RuntimeError(f"the warm-up request to {base_url} failed: {rec.error}")

        async def send_one(req: WorkloadRequest, prompt: list[int]) -> RequestRecord:
            body = completion_body(model, prompt, req.output_tokens, temperature, seed)
            return await _one_request(http, req, prompt, body, timeout)

        records, start, max_lag = await drive(
            requests,
            send_one,
            progress=progress,
            concurrency_limit=concurrency_limit,
            description=description,
        )
        wall = time.monotonic() - start
    settings = {
        "openai_url": base_url,
        "model": model,
        "timestamps": "client",
        "concurrency_limit": concurrency_limit,
        "temperature": temperature,
        "seed": seed,
        "warmup": warmup,
    }
    return ReplayOutcome(
        records=records,
        iterations=[],
        start_s=start,
        wall_s=wall,
        max_send_lag_s=max_lag,
        settings=settings,
    )
