"""The OpenAI-compatible HTTP server: a Starlette app that is a client of the frontend.

It never schedules anything itself: every request goes to the deployment's public
endpoint through one `AsyncClient` connection, as any SDK client's would. A client that
disconnects aborts its requests (the stream's generator is cancelled, which sends the
abort), so their KV blocks are free again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sarazmq import __version__
from sarazmq.api import responses
from sarazmq.api.dashboard import DashboardFeed, DashboardHub, DashboardSettings
from sarazmq.api.encoding import BodyTooLarge, decode_body, json_response, read_body
from sarazmq.api.errors import APIError
from sarazmq.api.metrics import ServerMetrics
from sarazmq.api.openapi import openapi_json
from sarazmq.api.pages import Handler, dashboard_data_routes, page_routes
from sarazmq.api.schemas import (
    UNBOUNDED_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    to_sampling_params,
)
from sarazmq.api.streams import Generation, open_generations, stream_chat, stream_completions
from sarazmq.client import AsyncClient, replica_summaries
from sarazmq.outputs import RequestOutput
from sarazmq.validation import InvalidRequestError

log = logging.getLogger("sarazmq.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class APIConfig:
    """What the HTTP server needs to know.

    endpoint: the deployment's public endpoint; model_name: the served model's id (what
    clients put in "model"); max_model_len: the context, for /v1/models; api_key: the
    bearer key /v1/ requires (None: open); max_body_bytes: the largest request body;
    curve_server_key: the deployment's CurveZMQ public key, if it has one;
    dashboard: the /dashboard page's window and poll interval.
    """

    endpoint: str
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    curve_server_key: bytes | None = None
    health_timeout: float = 10.0
    dashboard: DashboardSettings = DashboardSettings()


class OpenAIServer:
    """Routes and state of one server: the engine connection, the tokenizer (token
    strings for logprobs) and the metrics."""

    def __init__(self, config: APIConfig, token_text: Callable[[int], str]) -> None:
        self.config = config
        self.token_text = token_text
        self.metrics = ServerMetrics(config.model_name)
        self.client: AsyncClient | None = None
        self.dashboard = DashboardHub(
            DashboardFeed(config.model_name, config.dashboard), self._dashboard_stats
        )

    # ---- app ---------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/health", self._errors(self.health), methods=["GET"]),
            Route("/version", self._errors(self.version), methods=["GET"]),
            Route("/metrics", self._errors(self.prometheus), methods=["GET"]),
            Route("/openapi.json", self._errors(self.openapi), methods=["GET"]),
            Route("/v1/models", self._errors(self._auth(self.models)), methods=["GET"]),
            Route("/v1/completions", self._errors(self._auth(self.completions)), methods=["POST"]),
            Route(
                "/v1/chat/completions",
                self._errors(self._auth(self.chat_completions)),
                methods=["POST"],
            ),
            *dashboard_data_routes(self.dashboard, lambda h: self._errors(self._auth(h))),
            *page_routes(),
        ]

        async def not_found(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 404)
            message = "not found" if status == 404 else "method not allowed"
            # a 405 keeps Starlette's Allow header (RFC 9110 requires one)
            headers = dict(getattr(exc, "headers", None) or {})
            return APIError(status, f"{message}: {request.method} {request.url.path}",
                            type="not_found_error", headers=headers).response()  # fmt: skip

        return Starlette(
            routes=routes,
            lifespan=self._lifespan,
            exception_handlers={404: not_found, 405: not_found},
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(
            self.config.endpoint,
            curve_server_key=self.config.curve_server_key,
            heartbeat_timeout=30.0,
        )
        try:
            yield
        finally:
            await self.dashboard.close()
            await self.client.close()

    def _engine(self) -> AsyncClient:
        if self.client is None:
            raise APIError(503, "the server is not started", type="service_unavailable")
        return self.client

    def _errors(self, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return e.response()
            except InvalidRequestError as e:
                return APIError.invalid(e).response()
            except BodyTooLarge:
                limit = self.config.max_body_bytes
                return APIError(
                    413, f"request body is larger than {limit} bytes", type="request_too_large"
                ).response()
            except Exception as e:  # noqa: BLE001 - a bug is a 500 with its message, logged
                log.exception("error handling %s %s", request.method, request.url.path)
                return APIError(500, f"internal error: {type(e).__name__}: {e}",
                                type="internal_error").response()  # fmt: skip

        return wrapped

    def _auth(self, handler: Handler) -> Handler:
        key = self.config.api_key
        if key is None:
            return handler
        expected = f"Bearer {key}".encode()

        async def wrapped(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await handler(request)

        return wrapped

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                type="not_found_error",
                param="model",
            )

    # ---- plain endpoints ---------------------------------------------------------

    async def health(self, request: Request) -> Response:
        report = await self._engine().health(self.config.health_timeout)
        if not report.healthy:
            raise APIError(503, f"unhealthy: {report.reason}", type="service_unavailable")
        replicas = report.stats.get("replicas")
        if replicas:  # data-parallel replicas: which are up (200 while any serves)
            return json_response({"status": "ok", "replicas": replica_summaries(replicas)})
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})

    async def openapi(self, request: Request) -> Response:
        # no API key needed, as FastAPI's default: the description holds no secret (only
        # whether a key is needed) and clients and tools read it before they have one
        doc = openapi_json(
            model_name=self.config.model_name,
            max_model_len=self.config.max_model_len,
            bearer=self.config.api_key is not None,
        )
        return Response(doc, media_type="application/json")

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "sarazmq",
            "root": self.config.model_name,
            "max_model_len": self.config.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def _dashboard_stats(self, iterations_from: int) -> dict[str, Any]:
        return await self._engine().stats(timeout=5.0, iterations_from=iterations_from)

    async def prometheus(self, request: Request) -> Response:
        step = self.metrics.next_step
        stats = await self._engine().stats(timeout=5.0, iterations_from=max(step, -1))
        self.metrics.observe_stats(stats)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- generation ----------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = decode_body(await read_body(request, self.config.max_body_bytes), CompletionRequest)
        self._check_model(body.model)
        if body.echo:
            raise InvalidRequestError("echo=true is not supported", "echo")
        if body.best_of not in (None, 1):
            raise InvalidRequestError(f"best_of={body.best_of} is not supported", "best_of")
        if body.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        prompts = completion_prompts(body.prompt)
        params = to_sampling_params(
            body,
            logprobs=completion_logprobs(body),
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        )
        requests = [{"prompt": p, "params": params} for p in prompts]
        gens = await open_generations(self._engine(), requests, prompt_param="prompt")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            chunks = stream_completions(
                gens, self.config.model_name, self.token_text, include_usage, self._finished
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        outs = await self._collect(request, gens)
        choices = []
        for i, out in enumerate(outs):
            choice: dict[str, Any] = {
                "index": i,
                "text": out.text,
                "logprobs": None,
                "finish_reason": out.finish_reason or None,
            }
            if params.logprobs is not None:
                choice["logprobs"] = responses.completion_logprobs(
                    out.token_ids, out.logprobs, self.token_text, 0
                )
            choices.append(choice)
        return json_response(
            {
                "id": responses.new_id("cmpl"),
                "object": "text_completion",
                "created": responses.now(),
                "model": self.config.model_name,
                "choices": choices,
                "usage": responses.usage(
                    sum(len(o.prompt_token_ids) for o in outs),
                    sum(len(o.token_ids) for o in outs),
                ),
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        raw = await read_body(request, self.config.max_body_bytes)
        body = decode_body(raw, ChatCompletionRequest)
        self._check_model(body.model)
        messages = chat_messages(body.messages)
        params = to_sampling_params(
            body, logprobs=chat_logprobs(body), default_max_tokens=UNBOUNDED_MAX_TOKENS
        )
        gens = await open_generations(
            self._engine(), [{"messages": messages, "params": params}], prompt_param="messages"
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            chunks = stream_chat(
                gens[0], self.config.model_name, self.token_text, include_usage, self._finished
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        (out,) = await self._collect(request, gens)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": (
                responses.chat_logprobs(out.token_ids, out.logprobs, self.token_text)
                if params.logprobs is not None
                else None
            ),
            "finish_reason": out.finish_reason or None,
        }
        return json_response(
            {
                "id": responses.new_id("chatcmpl"),
                "object": "chat.completion",
                "created": responses.now(),
                "model": self.config.model_name,
                "choices": [choice],
                "usage": responses.usage(len(out.prompt_token_ids), len(out.token_ids)),
            }
        )

    def _finished(self, out: RequestOutput) -> None:
        self.metrics.observe_request(out)
        self.dashboard.feed.observe_request(out.arrival_time, out.token_times)

    async def _collect(self, request: Request, gens: list[Generation]) -> list[RequestOutput]:
        """Runs every generation to its end; a client that disconnects first cancels them
        (which aborts them on the engine)."""
        work = asyncio.ensure_future(asyncio.gather(*(g.collect() for g in gens)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
                raise APIError(499, "client disconnected", type="client_closed_request")
            outs = work.result()
        finally:
            gone.cancel()
            for g in gens:
                await g.close()
        for out in outs:
            self._finished(out)
        return outs


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its request body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
