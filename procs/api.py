"""HTTP server process: the OpenAI-compatible API, a client of the frontend's public endpoint."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from sarazmq.api import APIConfig, HTTPBind, serve_http
from sarazmq.model.source import load_tokenizer, resolve_model
from sarazmq.procs.common import ProcSpec, async_body, run_process


def api_config(spec: ProcSpec) -> APIConfig:
    """The HTTP server's config in a deployment: its frontend, model and limits."""
    dep = spec.deployment
    return APIConfig(
        endpoint=spec.endpoints.public,
        model_name=spec.config.model,
        max_model_len=spec.config.scheduler.max_model_len,
        api_key=dep.api_key,
        max_body_bytes=int(dep.max_body_mb * (1 << 20)),
        curve_server_key=dep.curve.public.encode() if dep.curve is not None else None,
    )


async def serve(spec: ProcSpec, ready: Callable[..., None]) -> None:
    dep = spec.deployment
    if dep.http_port is None:
        raise ValueError("the api process needs DeploymentConfig.http_port")
    tokenizer = load_tokenizer(resolve_model(spec.config.model, spec.config.load_format))
    # SIGTERM (from the launcher, after the drain) stops the server gracefully
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    url = f"http://{dep.http_host}:{dep.http_port}"
    await serve_http(
        api_config(spec),
        HTTPBind(dep.http_host, dep.http_port),
        tokenizer,
        on_listening=lambda: ready(url=url),
        log_level=dep.log_level,
        stop=stop,
    )


body = async_body(serve)

if __name__ == "__main__":
    run_process(body)
