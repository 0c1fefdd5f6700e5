"""What a finished (or streaming) request looks like to users of the engine and the SDK."""

from __future__ import annotations

import msgspec

from sarazmq.messages import TokenLogprobs


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's result.

    finish_reason: "stop" (EOS, stop id or stop string), "length" (max_tokens or the
    context), "abort", or "error" (then `error` says why). Server timestamps are
    seconds on the engine's monotonic clock: arrival, first scheduled, and the end of
    the iteration that produced each output token.
    """

    request_id: str
    prompt_token_ids: list[int] = []
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str = ""
    error: str = ""
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
