"""Running the HTTP server on uvicorn (uvloop), in a deployment's `api` process or alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from sarazmq.api.app import APIConfig, OpenAIServer
from sarazmq.procs.endpoints import check_http_bind

log = logging.getLogger("sarazmq.api")

#: seconds in-flight HTTP responses get to finish when the server is asked to stop
SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True)
class HTTPBind:
    """Where the server listens."""

    host: str = "127.0.0.1"
    port: int = 8000


def token_text_function(tokenizer: Any) -> Callable[[int], str]:
    """id -> its text, as logprobs show tokens (special tokens included)."""
    cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            if len(cache) < 1 << 16:
                cache[token_id] = text
        return text

    return token_text


async def serve_http(
    config: APIConfig,
    bind: HTTPBind,
    tokenizer: Any,
    on_listening: Callable[[], None] | None = None,
    log_level: str = "warning",
    stop: asyncio.Event | None = None,
) -> None:
    """Serves until `stop` is set (then shuts down gracefully: in-flight responses get
    `SHUTDOWN_GRACE_S`) or until cancelled; `on_listening` runs once the socket accepts
    connections."""
    check_http_bind(bind.host, config.api_key)
    app = OpenAIServer(config, token_text_function(tokenizer)).app()
    uv_config = uvicorn.Config(
        app,
        host=bind.host,
        port=bind.port,
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        # no server header, a short keep-alive: many short benchmark connections
        server_header=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(uv_config)
    # the process handles signals itself (the launcher's SIGTERM cancels the serving task)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task  # raises why it could not start
                raise RuntimeError(f"the HTTP server did not start on {bind.host}:{bind.port}")
            await asyncio.sleep(0.05)
        if on_listening is not None:
            on_listening()
        if stop is not None:
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            server.should_exit = True
        await task
    finally:
        server.should_exit = True
        if not task.done():
            await asyncio.wait({task}, timeout=5)
