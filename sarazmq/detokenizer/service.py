"""The detokenizer process's logic (socket-free): token deltas in, client text deltas out.

`DetokenizerService` holds one `IncrementalDetokenizer` per request of its shard; the
scheduler announces a request (`DetokenizerAdd`) before its first delta, on the same
socket. A stop string found in the text ends the request here (its output stops right
before the string) and must be reported to the scheduler (`stop_hits`), which then stops
computing it and frees its blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from sarazmq.detokenizer.incremental import IncrementalDetokenizer
from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import FINISH_STOP, MaybeFinishReason
from sarazmq.protocol.engine import (
    DeltaBatch,
    DetokenizerAdd,
    DetokenizerDrop,
    DetokenizerInbound,
    RequestDelta,
)
from sarazmq.sampling_params import SamplingParams


class TokenDelta(Protocol):
    """New tokens of one request (the scheduler's per-request delta has these fields).

    finish_reason: "" or None while running; "stop" (EOS or a stop token id: that last
    token's text is not part of the output), "length", "abort", ... when finished.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def new_token_ids(self) -> Sequence[int]: ...

    @property
    def finish_reason(self) -> str: ...


class TextOutput(msgspec.Struct, array_like=True, omit_defaults=True, tag="text"):
    """One request's incremental text.

    text: the delta since the previous TextOutput of this request.
    token_ids: the new token ids (cut after the one that completed a stop string).
    finish_reason: "" while running; "stop" when a stop string matched (then
        `stop_string_hit` is True and the caller must tell the scheduler to stop the
        request), else the delta's own finish reason.
    stop_reason: the matched stop string.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: MaybeFinishReason = ""
    stop_string_hit: bool = False
    stop_reason: str | None = None


@dataclass
class DetokenizeResult:
    """What one batch of token deltas becomes.

    outputs: the client-facing text deltas (one per input delta).
    stop_hits: requests a stop string just ended that the scheduler still runs: it must
        be told (`StopStringHit`) so they stop computing and free their blocks.
    """

    outputs: list[OutputDelta] = field(default_factory=list)
    stop_hits: list[str] = field(default_factory=list)


class DetokenizerService:
    """Incremental detokenizers of many requests; state is dropped when a request finishes.

    eos_token_ids: ids that end a request with finish_reason "stop" (their text is never
        part of the output); defaults to the tokenizer's `eos_token_id`.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [eos] if isinstance(eos, int) else []
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._requests: dict[str, tuple[IncrementalDetokenizer, SamplingParams]] = {}

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        replay_token_ids: Sequence[int] = (),
    ) -> None:
        """Starts tracking a request; raises ValueError if the id is already tracked.
        replay_token_ids: outputs another instance already streamed: fed without emitting
        their text, so this one goes on exactly where that one left off."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already being detokenized")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        if replay_token_ids:
            detok.step([int(t) for t in replay_token_ids])
        self._requests[request_id] = (detok, params)

    def abort(self, request_id: str) -> None:
        """Forgets a request (no-op if unknown)."""
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, delta: TokenDelta) -> TextOutput:
        """Detokenizes one request's new tokens.

        A request that is not tracked (tokens already in flight when a stop string
        finished it, or an aborted one) gets an empty TextOutput: no text, no tokens, no
        finish_reason, so the caller changes nothing.
        """
        entry = self._requests.get(delta.request_id)
        if entry is None:
            return TextOutput(request_id=delta.request_id)
        detok, params = entry
        ids = [int(t) for t in delta.new_token_ids]
        finish = delta.finish_reason or ""
        text_ids = ids
        if finish == FINISH_STOP and ids and self._is_stop_token(ids[-1], params):
            text_ids = ids[:-1]  # the EOS / stop token itself is not text

        step = detok.step(text_ids)
        text = step.text
        if step.stopped:
            self._requests.pop(delta.request_id, None)
            return TextOutput(
                request_id=delta.request_id,
                text=text,
                token_ids=ids[: step.num_tokens],
                finish_reason=FINISH_STOP,
                stop_string_hit=True,
                stop_reason=step.stop_reason,
            )
        if not finish:
            return TextOutput(request_id=delta.request_id, text=text, token_ids=ids)

        self._requests.pop(delta.request_id, None)
        text += detok.flush()
        hit = detok.stopped  # a stop string sat in the text held back until now
        return TextOutput(
            request_id=delta.request_id,
            text=text,
            token_ids=ids,
            finish_reason=FINISH_STOP if hit else finish,  # type: ignore[arg-type]
            stop_string_hit=hit,
            stop_reason=detok.stop_reason,
        )

    def _is_stop_token(self, tok: int, params: SamplingParams) -> bool:
        return tok in params.stop_token_ids or (tok in self.eos_token_ids and not params.ignore_eos)

    def detokenize(self, deltas: Iterable[RequestDelta]) -> DetokenizeResult:
        """Detokenizes a batch of scheduler deltas into client-facing deltas."""
        result = DetokenizeResult()
        for d in deltas:
            text = self.process(d)
            if text.stop_string_hit and not d.finish_reason:
                result.stop_hits.append(d.request_id)
            result.outputs.append(
                OutputDelta(
                    request_id=d.request_id,
                    text=text.text,
                    token_ids=list(d.new_token_ids),
                    finish_reason=text.finish_reason,
                    arrival_time=d.arrival_time,
                    first_scheduled_time=d.first_scheduled_time or 0.0,
                    token_times=list(d.token_times),
                    logprobs=list(d.logprobs),
                    num_preemptions=d.num_preemptions,
                )
            )
        return result

    def on_message(self, msg: DetokenizerInbound) -> DetokenizeResult:
        """One message from the scheduler: a request to track, or a batch to detokenize."""
        if isinstance(msg, DetokenizerAdd):
            self.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.replay_token_ids)
            return DetokenizeResult()
        if isinstance(msg, DetokenizerDrop):
            self.abort(msg.request_id)
            return DetokenizeResult()
        if isinstance(msg, DeltaBatch):
            return self.detokenize(msg.deltas)
        raise TypeError(f"detokenizer got an unexpected message {type(msg).__name__}")
