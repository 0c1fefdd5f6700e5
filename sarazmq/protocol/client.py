"""The public endpoint: client SDK (DEALER) <-> frontend (ROUTER).

`ClientMessage` is what a client may send, `ServerMessage` what it gets back. Everything a
client sends is untrusted: the frontend decodes it with a typed decoder for
`ClientMessage` and answers anything else with an error.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sarazmq.protocol.common import ErrorType, MaybeFinishReason, TokenLogprobs
from sarazmq.sampling_params import SamplingParams

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


class ResetPrefixCacheRequest(msgspec.Struct, tag="reset_prefix_cache", forbid_unknown_fields=True):
    """Forget every cached prefix block. Answered with a `StatsReply` whose stats are
    {"reset": bool, "error": why it was refused}; refused while any request holds KV
    blocks."""

    request_id: str


class Pong(msgspec.Struct, tag="pong", forbid_unknown_fields=True):
    """A client's answer to each `Heartbeat`: proof that it still reads its output.

    A client with requests in flight that sends no Pong for the frontend's client
    timeout is treated as gone and its requests are aborted (their KV blocks freed).
    """

    time: float


ClientMessage = GenerateRequest | AbortRequest | StatsRequest | ResetPrefixCacheRequest | Pong


# ---- frontend -> client --------------------------------------------------------------


class OutputDelta(msgspec.Struct, tag="delta", omit_defaults=True):
    """Newly generated text/tokens of one request; the last one has finish_reason set.

    finish_reason "error" comes with `error` naming the problem and, for a rejected
    request, `error_field` naming the offending field ("prompt", "params.temperature",
    "messages[0].role", ...) and `error_type` saying whose fault it is ("invalid_request",
    "overloaded": retry later, "engine"). The first delta of a request carries its prompt_token_ids.
    Timestamps are server monotonic seconds (arrival, first scheduled, end of the
    iteration of each token).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: MaybeFinishReason = ""
    error: str = ""
    error_field: str = ""
    error_type: ErrorType = ""
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
