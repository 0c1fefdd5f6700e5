"""What the client SDK raises and reports."""

from __future__ import annotations

from typing import Any

import msgspec


class EngineError(RuntimeError):
    """The engine is unreachable, died, timed out, or rejected a request."""


class RequestError(EngineError):
    """The engine refused or failed one request; `request_id` says which, `field` names
    the offending field when the input was bad ("prompt", "params.top_p", ...), and
    `error_type` says whose fault it is: "invalid_request", "overloaded" (retry later) or
    "engine"."""

    def __init__(
        self, request_id: str, message: str, field: str = "", error_type: str = ""
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.field = field
        self.error_type = error_type


class HealthReport(msgspec.Struct, kw_only=True):
    """Result of `health()`: a real one-token generation through every process.

    healthy: the generation finished in time. reason: why not (else ""). latency_s:
    how long the generation took. stats: the scheduler's stats when they could be read.
    """

    healthy: bool
    reason: str = ""
    latency_s: float = 0.0
    stats: dict[str, Any] = {}
