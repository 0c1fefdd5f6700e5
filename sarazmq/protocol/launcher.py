"""Every process -> the launcher: READY, a failed start, the end of a drain."""

from __future__ import annotations

from typing import Any

import msgspec


class Ready(msgspec.Struct, tag="ready", array_like=True):
    name: str
    pid: int
    info: dict[str, Any] = {}


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A process could not start (bad model, tp mismatch, ...): the reason, for the user."""

    name: str
    error: str


class Drained(msgspec.Struct, tag="drained", array_like=True):
    """From the frontend: after a `Drain`, no request is in flight any more."""

    num_finished: int
    num_aborted: int


LauncherInbound = Ready | Failed | Drained
