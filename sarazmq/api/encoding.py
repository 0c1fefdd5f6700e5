"""JSON in and out of the HTTP server with msgspec (faster than the stdlib's json)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sarazmq.validation import InvalidRequestError, find_invalid_field

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


class BodyTooLarge(Exception):
    """The request body is over the server's limit."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encoder.encode(body), status_code=status, media_type="application/json", headers=headers
    )


def sse_event(body: Any) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + _encoder.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or BodyTooLarge as soon as it passes `limit` bytes (a declared
    Content-Length over the limit is refused before anything is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes, body_type: type[T]) -> T:
    """The body as `body_type`; InvalidRequestError naming the field otherwise (malformed
    JSON and invalid UTF-8 name no field)."""
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as err:
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            value = None
        located = find_invalid_field(value, body_type) if value is not None else None
        if located is not None:
            raise located from None
        raise InvalidRequestError(f"invalid request body: {err}") from None
    except msgspec.DecodeError as err:
        raise InvalidRequestError(f"request body is not valid JSON: {err}") from None
