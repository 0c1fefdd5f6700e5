"""Messages of the deployment's sockets (client <-> frontend, and between processes).

Each socket carries one tagged union of msgspec Structs and is decoded with a typed
decoder for that union, so a frame of the wrong kind is a decode error, never a
surprise object. No pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sarazmq.messages import TokenLogprobs
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.request import RequestDelta

# Largest frame the public endpoint accepts. libzmq enforces it (ZMQ_MAXMSGSIZE) before a
# frame reaches Python: the peer that sends a bigger one is disconnected, so it cannot
# make the frontend buffer more than this.
MAX_CLIENT_FRAME_BYTES = 16 * 1024 * 1024


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


# ---- client -> frontend ------------------------------------------------------------


class GenerateRequest(
    msgspec.Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True
):
    """Exactly one of prompt / prompt_token_ids / messages must be set."""

    request_id: str
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None


class AbortRequest(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    request_id: str


class StatsRequest(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    """Scheduler state; with iterations_from >= 0 also the iteration records since that step."""

    request_id: str
    iterations_from: int = -1


class Pong(msgspec.Struct, tag="pong", forbid_unknown_fields=True):
    """A client's answer to each `Heartbeat`: proof that it still reads its output.

    A client with requests in flight that sends no Pong for the frontend's client
    timeout is treated as gone and its requests are aborted (their KV blocks freed).
    """

    time: float


ClientMessage = GenerateRequest | AbortRequest | StatsRequest | Pong


# ---- frontend -> client --------------------------------------------------------------


class OutputDelta(msgspec.Struct, tag="delta", omit_defaults=True):
    """Newly generated text/tokens of one request; the last one has finish_reason set.

    finish_reason "error" comes with `error` naming the problem and, for a rejected
    request, `error_field` naming the offending field ("prompt", "params.temperature",
    "messages[0].role", ...). The first delta of a request carries its prompt_token_ids.
    Timestamps are server monotonic seconds (arrival, first scheduled, end of the
    iteration of each token).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str = ""
    error: str = ""
    error_field: str = ""
    prompt_token_ids: list[int] = []
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    token_times: list[float] = []
    logprobs: list[TokenLogprobs | None] = []
    num_preemptions: int = 0


class StatsReply(msgspec.Struct, tag="stats_reply"):
    request_id: str
    stats: dict[str, Any]


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent to clients with requests in flight, so a dead engine is noticed, not waited on.

    Clients answer each one with a `Pong` carrying the same time.
    """

    time: float


class ProtocolError(msgspec.Struct, tag="protocol_error"):
    """A frame from this client could not be understood (no request id could be read)."""

    error: str


ServerMessage = OutputDelta | StatsReply | Heartbeat | ProtocolError


# ---- frontend / detokenizers -> scheduler --------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class StopStringHit(msgspec.Struct, tag="stop_hit", array_like=True):
    """A detokenizer saw a stop string: the scheduler finishes the request and frees it."""

    request_id: str


class StatsQuery(msgspec.Struct, tag="stats", array_like=True):
    request_id: str
    iterations_from: int = -1


SchedulerInbound = AddRequest | Abort | StopStringHit | StatsQuery


# ---- scheduler -> detokenizers -------------------------------------------------------


class DetokenizerAdd(msgspec.Struct, tag="dadd", array_like=True):
    """Sent before any delta of the request, on the same socket (so it arrives first)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class DeltaBatch(msgspec.Struct, tag="deltas", array_like=True):
    """All token deltas of one iteration for one detokenizer shard."""

    deltas: list[RequestDelta]


DetokenizerInbound = DetokenizerAdd | DeltaBatch


# ---- scheduler / detokenizers -> frontend --------------------------------------------


class OutputBatch(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[OutputDelta]


class StatsAnswer(msgspec.Struct, tag="stats_answer", array_like=True):
    request_id: str
    stats: dict[str, Any]


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """From the launcher: a process died; fail every in-flight request with `reason`."""

    reason: str


class Drain(msgspec.Struct, tag="drain", array_like=True):
    """From the launcher (SIGTERM): refuse new requests, let in-flight ones finish for up
    to `timeout` seconds, abort the rest, then answer `Drained`."""

    timeout: float


FrontendInbound = OutputBatch | StatsAnswer | EngineDead | Drain


# ---- every process -> launcher -------------------------------------------------------


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
