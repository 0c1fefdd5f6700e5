"""The reply to a client frame that is not a valid `ClientMessage`, or whose handling failed."""

from __future__ import annotations

import msgspec

from sarazmq.frontend.actions import REJECT_INVALID
from sarazmq.protocol.client import ClientMessage, OutputDelta, ProtocolError
from sarazmq.protocol.common import ERROR_ENGINE, ERROR_INVALID, FINISH_ERROR
from sarazmq.validation import InvalidRequestError, find_invalid_field


def invalid_frame_reply(
    frame: bytes, kind: str, err: Exception
) -> tuple[OutputDelta | ProtocolError, str]:
    """(reply, text) for an undecodable frame: an error to its request id if one can be
    read, else a `ProtocolError`. A frame that is msgpack but not a valid `ClientMessage`
    (kind REJECT_INVALID) is walked against the expected type to name the offending field
    (`find_invalid_field`)."""
    rid = None
    invalid: InvalidRequestError | None = None
    if kind == REJECT_INVALID:  # undecodable frames have no readable id by definition
        raw = _raw(frame)
        rid = _request_id(raw)
        if raw is not None:
            invalid = find_invalid_field(raw, ClientMessage)
    if invalid is not None:
        where = f" ({invalid.field})" if invalid.field else ""
        text = f"invalid request{where}: {invalid.message}"[:1000]
    else:
        text = f"invalid request: {type(err).__name__}: {err}"[:1000]
    if rid is None:
        return ProtocolError(error=text), text
    reply = OutputDelta(
        request_id=rid,
        finish_reason=FINISH_ERROR,
        error=text,
        error_field=invalid.field if invalid is not None else "",
        error_type=ERROR_INVALID,
    )
    return reply, text


def handler_failed_reply(frame: bytes, err: Exception) -> OutputDelta | ProtocolError:
    """The reply to a frame whose handling raised inside the frontend (a bug, not the
    sender's input): an engine error to its request id where one can be read, else a
    `ProtocolError`, so that the sender is answered instead of waiting for its timeout."""
    text = f"the engine failed handling this message: {type(err).__name__}: {err}"[:1000]
    rid = _request_id(_raw(frame))
    if rid is not None:
        return OutputDelta(
            request_id=rid,
            finish_reason=FINISH_ERROR,
            error=text,
            error_type=ERROR_ENGINE,
        )
    return ProtocolError(error=text)


def _raw(frame: bytes) -> object:
    """The frame as plain msgpack data, None where it is not msgpack."""
    try:
        return msgspec.msgpack.decode(frame)
    except Exception:  # noqa: BLE001 - any garbage is just "nothing readable"
        return None


def _request_id(raw: object) -> str | None:
    """The request id a decoded frame carries (at most 256 characters), if it has one."""
    if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
        return raw["request_id"][:256]
    return None
