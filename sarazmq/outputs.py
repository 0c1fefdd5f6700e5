"""What a finished (or streaming) request looks like to users of the engine and the SDK."""

from __future__ import annotations

import msgspec

from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import MaybeFinishReason, TokenLogprobs


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's result.

    finish_reason: "stop" (EOS, stop id or stop string), "length" (max_tokens or the
    context), "abort", or "error" (then `error` says why and `error_field` names the
    offending input field, when one is to blame). Server timestamps are seconds on the
    engine's monotonic clock: arrival, first scheduled, and the end of the iteration that
    produced each output token.
    """

    request_id: str
    prompt_token_ids: list[int] = []
    token_ids: list[int] = []
    text: str = ""
    finish_reason: MaybeFinishReason = ""
    error: str = ""
    error_field: str = ""
    logprobs: list[TokenLogprobs | None] = []
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    token_times: list[float] = []
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def apply(self, delta: OutputDelta) -> None:
        """Merges one streamed delta of this request into the output (the one merge,
        used by the SDK and the in-process engine alike)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.token_times.extend(delta.token_times)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_token_ids:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.arrival_time:
            self.arrival_time = delta.arrival_time
        if delta.first_scheduled_time:
            self.first_scheduled_time = delta.first_scheduled_time
        self.num_preemptions = max(self.num_preemptions, delta.num_preemptions)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
            self.error_field = delta.error_field
