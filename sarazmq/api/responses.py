"""OpenAI response bodies (whole and streamed chunks) from our outputs and deltas."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sarazmq.protocol.common import TokenLogprobs

TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    token_text: TokenText,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for these tokens (offsets from text_offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, lp in zip(token_ids, logprobs):
        text = token_text(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lp.logprob)
        top = {token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], token_text: TokenText
) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tok, lp in zip(token_ids, logprobs):
        text = token_text(tok)
        entry: dict[str, Any] = {
            "token": text,
            "logprob": lp.logprob if lp is not None else None,
            "bytes": list(text.encode()),
            "top_logprobs": [],
        }
        if lp is not None:
            entry["top_logprobs"] = [
                {"token": (t := token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for i, v in zip(lp.top_token_ids, lp.top_logprobs)
            ]
        content.append(entry)
    return {"content": content}


def finish_reason(reason: str) -> str | None:
    """Ours -> OpenAI's (None while running; "abort" is vLLM's own)."""
    return reason or None
