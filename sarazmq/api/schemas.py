"""OpenAI request bodies (and vLLM's extensions) as msgspec Structs, and their translation.

Field names and types follow the OpenAI API; unknown fields are accepted and ignored, as
OpenAI does. `to_sampling_params` turns a body into our `SamplingParams`; every rejection
is an `InvalidRequestError` whose field is the OpenAI parameter name ("max_tokens",
"messages[0].role", ...), which the server returns as `error.param`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sarazmq.sampling_params import MAX_INT, MAX_LOGPROBS, SamplingParams
from sarazmq.validation import InvalidRequestError

# one prompt (text or token ids) or a batch (a list of either); msgspec takes one array type
# in a union, so the list's items are checked by `completion_prompts`
PromptInput = str | list[Any]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling parameters shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


#: max_tokens when a request names none: as much as the context allows (OpenAI's
#: completions default is 16; vLLM's and ours for chat is "the rest of the context")
UNBOUNDED_MAX_TOKENS = 1 << 30


def to_sampling_params(
    body: SamplingFields, *, logprobs: int | None, default_max_tokens: int
) -> SamplingParams:
    """Our SamplingParams for an OpenAI body; InvalidRequestError names the OpenAI field."""
    if body.n != 1:
        raise InvalidRequestError(f"n={body.n} is not supported: only n=1 is", "n")
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or []),
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "seed": body.seed,
        "logprobs": logprobs,
        "cache_salt": body.cache_salt,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if fields.get("top_k") == 0:
        fields["top_k"] = -1  # vLLM and the OpenAI clients use 0 for "off" too
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as e:
        if e.field == "max_tokens" and isinstance(body, ChatCompletionRequest):
            if body.max_completion_tokens is not None:
                raise InvalidRequestError(e.message, "max_completion_tokens") from None
        raise


def completion_logprobs(body: CompletionRequest) -> int | None:
    """The number of top logprobs a completion asks for (None: none)."""
    if body.logprobs is None:
        return None
    if not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs={body.logprobs} is out of range; allowed: [0, {MAX_LOGPROBS}]", "logprobs"
        )
    return body.logprobs


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The number of top logprobs a chat completion asks for (None: none)."""
    if not body.logprobs:
        if body.top_logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        return None
    n = body.top_logprobs or 0
    if not 0 <= n <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs={n} is out of range; allowed: [0, {MAX_LOGPROBS}]", "top_logprobs"
        )
    return n


def completion_prompts(prompt: PromptInput) -> list[str | list[int]]:
    """The prompts of a completion body: one per choice; InvalidRequestError("prompt")."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be an empty list", "prompt")
    if all(_is_token_id(p) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, a list of token ids (ints >= 0) or a "
        "list of lists of token ids",
        "prompt",
    )


def _is_token_id(value: Any) -> bool:
    """An int the engine can be sent (out-of-vocabulary ids are its to refuse)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def chat_messages(messages: list[ChatMessageIn]) -> list[dict[str, str]]:
    """The conversation as {"role", "content"} dicts; text parts of a content list are
    joined (images and audio are refused)."""
    if not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        "only text content parts are supported",
                        f"messages[{i}].content[{j}]",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": m.role, "content": content})
    return out
