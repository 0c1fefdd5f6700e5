"""The HTTP API's OpenAPI 3.1 description, served at GET /openapi.json.

Request bodies are generated with `msgspec.json.schema_components` from the very structs
the server decodes bodies into (`sarazmq.api.schemas`), so the description cannot drift
from what the server accepts. Response bodies are described by the documentation-only
structs below (the handlers build plain dicts, for speed); `tests/test_openapi.py` checks
them against a live server's answers, with schemathesis.

`OPERATIONS` lists every route the server has, with its method; the app's routes and it
are compared by a test, so a new route cannot go undocumented.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from sarazmq import __version__
from sarazmq.api.schemas import ChatCompletionRequest, CompletionRequest

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{name}"
BEARER_SCHEME = "bearerAuth"


# ---- response bodies (documentation only) -----------------------------------------------


class ErrorObject(msgspec.Struct):
    """What went wrong: `param` names the offending request field (null when no one
    field is to blame); `code` is the HTTP status."""

    message: str
    type: str
    param: str | None
    code: int


class Error(msgspec.Struct):
    """Every error response, in OpenAI's shape."""

    error: ErrorObject


class Model(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: str
    data: list[Model]


class Version(msgspec.Struct):
    version: str


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    """A whole completion (`stream: false`); with `stream: true` the body is server-sent
    events of chunks of this shape, ended by `data: [DONE]`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct):
    """One event of a streamed completion: a delta of text per choice; the last, with
    `stream_options.include_usage`, has no choices and the usage."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    """A whole chat completion (`stream: false`); with `stream: true` the body is
    server-sent events of `chat.completion.chunk` objects, ended by `data: [DONE]`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One event of a streamed chat completion: the role first, then content deltas;
    the last, with `stream_options.include_usage`, has no choices and the usage."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# every struct with a component of its own: the request bodies first (what the server
# decodes), then the responses
COMPONENT_TYPES: tuple[type[msgspec.Struct], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    Error,
    ModelList,
    Version,
    Completion,
    ChatCompletion,
    CompletionChunk,
    ChatCompletionChunk,
)


def _event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes an event stream's events
    one by one): its `data` is a JSON chunk, an error object if the engine fails
    mid-stream, or `[DONE]` at the end."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"a {chunk} or an Error as JSON; [DONE] last",
                # anyOf, not oneOf: contentSchema is only an annotation to most validators
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": REF_TEMPLATE.format(name=chunk)},
                                {"$ref": REF_TEMPLATE.format(name="Error")},
                            ]
                        },
                    },
                ],
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


#: hand-written components: the events of the two streams
EVENT_COMPONENTS = {
    "CompletionEvent": _event_schema("CompletionChunk"),
    "ChatCompletionEvent": _event_schema("ChatCompletionChunk"),
}


# ---- operations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    """One route and method: what it takes and answers. `body`: the struct its request
    body decodes into; `responses`: status -> (why, media type -> component name, or None
    for no schema beyond the media type's: a string, or any JSON object); `auth`: behind
    the API key when one is configured."""

    path: str
    method: str
    operation_id: str
    summary: str
    responses: dict[str, tuple[str, dict[str, str | None]]]
    body: type[msgspec.Struct] | None = None
    auth: bool = False


JSON = "application/json"
ERROR = {JSON: "Error"}


def _error_responses(*statuses: str) -> dict[str, tuple[str, dict[str, str | None]]]:
    why = {
        "400": "an invalid request: `error.param` names the field",
        "401": "a missing or wrong API key (only when the server has one)",
        "404": "an unknown model (`error.param` is `model`)",
        "413": "a request body over the server's limit",
        "503": "the engine is overloaded (with Retry-After), down or not started",
    }
    return {s: (why[s], ERROR) for s in statuses}


def _generation_responses(
    component: str, event: str
) -> dict[str, tuple[str, dict[str, str | None]]]:
    return {
        "200": (
            "the generation; server-sent events when `stream` is true",
            {JSON: component, "text/event-stream": event},
        ),
        **_error_responses("400", "401", "404", "413", "503"),
    }


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "/health",
        "get",
        "health",
        "Whether the engine serves: 200 or 503",
        {
            # vLLM's answer: an empty 200 (a data-parallel deployment's has a JSON body
            # of its replicas, `sarazmq.client.replica_summaries`, and stays 200 while
            # any serves)
            "200": ("healthy", {}),
            **_error_responses("503"),
        },
    ),
    Operation(
        "/version",
        "get",
        "version",
        "The server's version",
        {"200": ("the version", {JSON: "Version"})},
    ),
    Operation(
        "/metrics",
        "get",
        "metrics",
        "Prometheus metrics, in the text exposition format",
        {"200": ("the metrics", {"text/plain": None}), **_error_responses("503")},
    ),
    Operation(
        "/openapi.json",
        "get",
        "openapi",
        "This description",
        {"200": ("the OpenAPI document", {JSON: None})},
    ),
    Operation(
        "/dashboard",
        "get",
        "dashboardPage",
        "The live dashboard page (its data comes from /dashboard/events)",
        {"200": ("the page", {"text/html": None})},
    ),
    Operation(
        "/chat",
        "get",
        "chatPage",
        "The chat page (it talks to /v1/chat/completions)",
        {"200": ("the page", {"text/html": None})},
    ),
    Operation(
        "/dashboard/state",
        "get",
        "dashboardState",
        "One dashboard snapshot: the last iterations, queues, KV use, latency window",
        {"200": ("the snapshot", {JSON: None}), **_error_responses("401")},
        auth=True,
    ),
    Operation(
        "/dashboard/events",
        "get",
        "dashboardEvents",
        "Dashboard snapshots as server-sent events, one per poll of the engine, until "
        "the client leaves",
        {"200": ("the stream", {"text/event-stream": None}), **_error_responses("401")},
        auth=True,
    ),
    Operation(
        "/v1/models",
        "get",
        "listModels",
        "The served model",
        {"200": ("the model list", {JSON: "ModelList"}), **_error_responses("401")},
        auth=True,
    ),
    Operation(
        "/v1/completions",
        "post",
        "createCompletion",
        "Completes a prompt (text, token ids, or a batch of either)",
        _generation_responses("Completion", "CompletionEvent"),
        body=CompletionRequest,
        auth=True,
    ),
    Operation(
        "/v1/chat/completions",
        "post",
        "createChatCompletion",
        "Answers a conversation, rendered with the model's chat template",
        _generation_responses("ChatCompletion", "ChatCompletionEvent"),
        body=ChatCompletionRequest,
        auth=True,
    ),
)


# ---- the document -----------------------------------------------------------------------


def _media(component: str | None, media_type: str) -> dict[str, Any]:
    if component is not None:
        return {"schema": {"$ref": REF_TEMPLATE.format(name=component)}}
    if media_type == JSON:
        return {"schema": {"type": "object"}}
    return {"schema": {"type": "string"}}


def _operation(op: Operation, bearer: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "responses": {
            status: {"description": why}
            | ({"content": {m: _media(c, m) for m, c in media.items()}} if media else {})
            for status, (why, media) in op.responses.items()
        },
    }
    if op.body is not None:
        ref = REF_TEMPLATE.format(name=op.body.__name__)
        out["requestBody"] = {"required": True, "content": {JSON: {"schema": {"$ref": ref}}}}
    if op.auth and bearer:
        out["security"] = [{BEARER_SCHEME: []}]
    else:
        out["security"] = []  # open: no key is needed, whatever the document's default
        out["responses"].pop("401", None)
    return out


def openapi_document(*, model_name: str, max_model_len: int, bearer: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 description of a server serving `model_name`; `bearer`: /v1/
    needs `Authorization: Bearer <key>` (the server was given an API key)."""
    _, components = msgspec.json.schema_components(COMPONENT_TYPES, ref_template=REF_TEMPLATE)
    components |= EVENT_COMPONENTS
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, bearer)
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "sarazmq OpenAI-compatible API",
            "version": __version__,
            "description": (
                f"Serves {model_name!r} (context: {max_model_len} tokens). Request bodies "
                "are the structs the server decodes; unknown fields are accepted and "
                "ignored, as OpenAI does. Every error is "
                '{"error": {"message", "type", "param", "code"}}.'
            ),
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    if bearer:
        doc["components"]["securitySchemes"] = {BEARER_SCHEME: {"type": "http", "scheme": "bearer"}}
    return doc


@functools.lru_cache(maxsize=4)
def openapi_json(*, model_name: str, max_model_len: int, bearer: bool) -> bytes:
    """`openapi_document` encoded once per server configuration (it never changes)."""
    return msgspec.json.encode(
        openapi_document(model_name=model_name, max_model_len=max_model_len, bearer=bearer)
    )
