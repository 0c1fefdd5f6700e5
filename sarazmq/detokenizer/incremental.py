"""One request's output tokens to text deltas, with stop strings (`IncrementalDetokenizer`).

Decoding uses the same algorithm as `tokenizers.decoders.DecodeStream` (a window of the
tokens behind the last emitted chunk plus the new ones is decoded, and the text past the
window's previous decoding is the new chunk), written out here because DecodeStream keeps
its pending tokens private (so `flush` could not release them) and raises when the prompt
ends in the middle of a multi-byte character. The window starts with the last few prompt
tokens so decoders that strip a leading space at the start of a text (SentencePiece
"▁") do not strip it from the first output token.

Rules:
- never emit a broken UTF-8 sequence: while the decoded window ends in U+FFFD (the
  replacement character: an incomplete multi-byte sequence, e.g. the first of three
  byte-level tokens of "語"), its tokens are held back;
- stop strings: text that could still turn into a stop string (the longest suffix that is
  a proper prefix of some stop string, so at most len(longest stop) - 1 characters) is
  held back; when a stop string appears the output ends right before it and nothing after
  it is ever emitted. As in vLLM, stop strings count only from the token at output index
  min_tokens on;
- special tokens are skipped per `SamplingParams.skip_special_tokens`.

With a fast tokenizer the concatenated deltas equal `tokenizer.decode(output_ids)` except
for tokenizer-level clean-ups done by `transformers` only (`clean_up_tokenization_spaces`),
and the leading space a SentencePiece decoder strips at the start of a text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sarazmq.sampling_params import SamplingParams

# prompt tokens decoded in front of the first output tokens (vLLM uses 5 as well)
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerStep:
    """The result of feeding tokens to an `IncrementalDetokenizer`.

    text: the delta safe to emit now.
    stopped: a stop string matched (the request must stop; `text` ends before it).
    stop_reason: the matched stop string, else None.
    num_tokens: how many of the fed tokens were consumed (all of them unless a stop string
        matched part way: the rest come after the stop and are dropped).
    """

    text: str
    stopped: bool = False
    stop_reason: str | None = None
    num_tokens: int = 0


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A `ids -> str` function: the Rust tokenizer of a fast transformers tokenizer when
    there is one (no Python-side clean-ups), else the tokenizer's own `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch"):  # a bare tokenizers.Tokenizer
        backend = tokenizer
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One request's output tokens -> text deltas, with stop strings.

    After `stopped` (a stop string matched) or `flush()`, further tokens are ignored.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._decode = _make_decode(tokenizer, params.skip_special_tokens)
        self._stops: list[str] = list(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._min_tokens = params.min_tokens
        # DecodeStream state: `_ids` is the decoding window, `_prefix` the decoding of its
        # first `_prefix_len` ids (text already handed on); the ids past them are pending.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = self._decode(self._ids) if self._ids else ""
        self._prefix_len = len(self._ids)
        self._text = ""  # complete characters decoded so far (up to a stop string)
        self._emitted = 0  # how much of _text has been returned
        self.num_tokens = 0  # output tokens consumed
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False  # stopped or flushed

    @property
    def text(self) -> str:
        """The full output text emitted so far."""
        return self._text[: self._emitted]

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        """Feeds newly sampled tokens; returns the text delta that is safe to emit now."""
        if self.finished:
            return DetokenizerStep("", self.stopped, self.stop_reason, 0)
        consumed = 0
        for tok in new_token_ids:
            consumed += 1
            output_index = self.num_tokens
            self.num_tokens += 1
            chunk = self._decode_next(int(tok))
            if chunk and self._append(chunk, check_stops=output_index >= self._min_tokens):
                break
        return DetokenizerStep(self._release(), self.stopped, self.stop_reason, consumed)

    def flush(self) -> str:
        """On a finish for another reason: releases all held-back text and finishes.

        Text held for a possible stop string is released (unless it does hold a stop
        string, in which case `stopped` is set and the text ends before it); an incomplete
        multi-byte sequence at the very end is dropped rather than emitted as U+FFFD.
        """
        if self.finished:
            return ""
        if len(self._ids) > self._prefix_len:
            chunk = self._new_text(self._decode(self._ids)).rstrip(REPLACEMENT_CHAR)
            if chunk:
                self._append(chunk, check_stops=self.num_tokens > self._min_tokens)
        self.finished = True
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta

    # -- internals ---------------------------------------------------------------------

    def _decode_next(self, tok: int) -> str:
        """DecodeStream's step: the new complete text after adding `tok`, or ""."""
        self._ids.append(tok)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new (e.g. a skipped special token) or an incomplete char
        chunk = self._new_text(text)
        # slide the window: the ids behind the previous chunk are no longer needed
        del self._ids[: self._prefix_len]
        self._prefix = self._decode(self._ids)
        self._prefix_len = len(self._ids)
        return chunk

    def _new_text(self, text: str) -> str:
        if text.startswith(self._prefix):
            return text[len(self._prefix) :]
        # the window started with an incomplete character (the prompt ended inside one)
        # that the new tokens completed: emit the completed character too
        base = self._prefix.rstrip(REPLACEMENT_CHAR)
        if text.startswith(base):
            return text[len(base) :]
        return text[len(self._prefix) :]

    def _append(self, chunk: str, check_stops: bool) -> bool:
        """Adds decoded text; returns True (and truncates) when a stop string completed."""
        old_len = len(self._text)
        self._text += chunk
        if not (self._stops and check_stops):
            return False
        best: tuple[int, str] | None = None
        for s in self._stops:
            # an occurrence not found before must end inside the new chunk
            at = self._text.find(s, max(0, old_len - len(s) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        # emitted text never reaches into a stop string: it was held back (see _holdback)
        self._text = self._text[: best[0]]
        self.stopped = self.finished = True
        self.stop_reason = best[1]
        return True

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        if not self._stops:
            return 0
        tail = self._text[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self) -> str:
        end = len(self._text) if self.stopped else len(self._text) - self._holdback()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
