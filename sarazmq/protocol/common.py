"""Wire types shared by several socket families."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

#: Why a request ended: "stop" (EOS, a stop token id or a stop string), "length"
#: (max_tokens or the model context), "abort" (the client or the operator), "error" (the
#: request was rejected or the engine failed; an error message says why).
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
FINISH_STOP: FinishReason = "stop"
FINISH_LENGTH: FinishReason = "length"
FINISH_ABORT: FinishReason = "abort"
FINISH_ERROR: FinishReason = "error"
#: Why a request failed (with finish reason "error"): its input was invalid (the error
#: names the field), the engine is overloaded or shutting down (retry later), or the
#: engine failed.
ErrorType = Literal["", "invalid_request", "overloaded", "engine"]
ERROR_INVALID: ErrorType = "invalid_request"
ERROR_OVERLOADED: ErrorType = "overloaded"
ERROR_ENGINE: ErrorType = "engine"

#: A finish reason, or "" while the request is still running.
MaybeFinishReason = Literal["", "stop", "length", "abort", "error"]


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled token and the top-N alternatives."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
