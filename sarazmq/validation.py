"""The one validation layer: typed errors that name their field, and the checks behind them.

Every check of user input raises `InvalidRequestError`, which carries the offending field
("prompt", "params.top_p", "messages[0].role", ...) as data, so no caller ever recovers a
field from an error's text. The SDK's `RequestError.field`, the frontend's
`OutputDelta.error_field` and the HTTP server's `error.param` all come from it.

- `SamplingParams` checks its own ranges (it raises `InvalidRequestError` from
  `__post_init__`, which msgspec also runs on decode).
- `check_prompt_token_ids` / `check_messages`: the prompt checks, used by the frontend's
  tokenizer and by the scheduler (which also guards the in-process engine).
- `find_invalid_field`: after a typed decode failed, walks the undecoded value against
  the expected type and returns the first field that does not convert, as an
  `InvalidRequestError` (msgspec reports its path only inside its message text).
"""

from __future__ import annotations

import operator
import types
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

VALID_ROLES = ("system", "user", "assistant", "tool")
EMPTY_PROMPT = "prompt is empty: an empty prompt has no token to continue from"


class InvalidRequestError(ValueError):
    """Bad input: `field` names what is wrong ("" when no one field is), `message` why."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def under(self, prefix: str) -> InvalidRequestError:
        """The same error with its field nested under `prefix` ("params" + "top_p")."""
        return InvalidRequestError(self.message, join_field(prefix, self.field))


def join_field(prefix: str, name: str) -> str:
    """'params' + 'top_p' -> 'params.top_p'; 'messages' + '[0]' -> 'messages[0]'."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}{name}" if name.startswith("[") else f"{prefix}.{name}"


# ---------------------------------------------------------------------------- prompts


def _plain_ints_in_range(token_ids: Sequence[Any], vocab_size: int | None) -> bool:
    """Whether `token_ids` is a list of plain ints in [0, vocab_size): the common case,
    checked at C speed (a client's and the simulator's prompts; the loop below names
    the bad ids of any other)."""
    if type(token_ids) is not list or not token_ids or set(map(type, token_ids)) != {int}:
        return False
    return min(token_ids) >= 0 and (vocab_size is None or max(token_ids) < vocab_size)


def check_prompt_token_ids(
    token_ids: Sequence[Any],
    *,
    max_model_len: int,
    vocab_size: int | None = None,
    max_kv_tokens: int | None = None,
    field: str = "prompt",
) -> list[int]:
    """The prompt as a list of ints, or InvalidRequestError(field) naming what is wrong.

    Token ids must be ints (anything with __index__, not bools) >= 0 and below
    `vocab_size` when given; the prompt must be non-empty, leave room for one output token
    in `max_model_len`, and fit the KV pool (`max_kv_tokens`) when given.
    """
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, not {type(token_ids).__name__}",
            field,
        )
    ids: list[int] = []
    bad: list[Any] = []
    if _plain_ints_in_range(token_ids, vocab_size):
        ids = list(token_ids)
        token_ids = ()  # nothing left to check one by one
    for t in token_ids:
        try:
            v = -1 if isinstance(t, bool) else operator.index(t)
        except TypeError:
            v = -1
        if v < 0 or (vocab_size is not None and v >= vocab_size):
            bad.append(t)
        ids.append(v)
    if bad:
        allowed = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidRequestError(
            f"prompt token ids must be ints {allowed}; got {bad[:5]!r}", field
        )
    if not ids:
        raise InvalidRequestError(EMPTY_PROMPT, field)
    n = len(ids)
    if n > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens, more than the model's context of {max_model_len}", field
        )
    if n == max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens, which leaves no room for output in the model's context "
            f"of {max_model_len} tokens",
            field,
        )
    if max_kv_tokens is not None and n > max_kv_tokens:
        raise InvalidRequestError(
            f"prompt has {n} tokens but the whole KV pool holds only {max_kv_tokens}", field
        )
    return ids


def check_messages(messages: Any, field: str = "messages") -> None:
    """Raises InvalidRequestError naming the first malformed message of a chat."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role', 'content'} dicts", field
        )
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content'", where)
        role, content = m.get("role"), m.get("content")
        if role not in VALID_ROLES:
            raise InvalidRequestError(
                f"{where}.role={role!r} is not one of {VALID_ROLES}", f"{where}.role"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string", f"{where}.content")


# ---------------------------------------------------------------------------- decoding


def find_invalid_field(raw: Any, expected: Any, path: str = "") -> InvalidRequestError | None:
    """The first part of `raw` (an undecoded msgpack/JSON value) that is not a valid
    `expected` (a msgspec Struct, a tagged union of them, a list or optional of them, or a
    plain type), as an InvalidRequestError naming its field; None if `raw` is valid.

    Unknown fields of a struct that forbids them, missing required fields, values of the
    wrong type and a struct's own checks (`__post_init__` raising InvalidRequestError) are
    each reported with their dotted path.
    """
    try:
        msgspec.convert(raw, expected)
        return None
    except msgspec.ValidationError as err:
        error = err
    structs = _struct_members(expected)
    if isinstance(raw, dict) and structs:
        return _invalid_struct_field(raw, structs, path, error)
    item = _list_item_type(expected)
    if isinstance(raw, list) and item is not None:
        for i, value in enumerate(raw):
            inner = find_invalid_field(value, item, f"{path}[{i}]")
            if inner is not None:
                return inner
    return InvalidRequestError(_without_path(str(error)), path)


def _invalid_struct_field(
    raw: dict[Any, Any],
    structs: list[type[msgspec.Struct]],
    path: str,
    error: msgspec.ValidationError,
) -> InvalidRequestError:
    cls = structs[0]
    tag_field = cls.__struct_config__.tag_field
    if len(structs) > 1 or cls.__struct_config__.tag is not None:
        by_tag = {s.__struct_config__.tag: s for s in structs}
        tag = raw.get(tag_field)
        if tag not in by_tag:
            return InvalidRequestError(
                f"unknown message type {tag!r}; expected one of {sorted(map(str, by_tag))}",
                join_field(path, tag_field or ""),
            )
        cls = by_tag[tag]
    fields = msgspec.structs.fields(cls)
    names = {f.encode_name for f in fields}
    if cls.__struct_config__.forbid_unknown_fields:
        for key in raw:
            if key not in names and key != tag_field:
                return InvalidRequestError(f"unknown field {key!r}", join_field(path, str(key)))
    for f in fields:
        where = join_field(path, f.encode_name)
        if f.encode_name not in raw:
            if f.required:
                return InvalidRequestError(f"missing required field {f.encode_name!r}", where)
            continue
        inner = find_invalid_field(raw[f.encode_name], f.type, where)
        if inner is not None:
            return inner
    # every field is valid on its own: the struct's own checks (__post_init__) failed
    cause = error.__cause__
    if isinstance(cause, InvalidRequestError):
        return cause.under(path)
    return InvalidRequestError(_without_path(str(error)), path)


def _union_args(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _struct_members(tp: Any) -> list[type[msgspec.Struct]]:
    return [a for a in _union_args(tp) if isinstance(a, type) and issubclass(a, msgspec.Struct)]


def _list_item_type(tp: Any) -> Any:
    for a in _union_args(tp):
        if typing.get_origin(a) is list:
            (item,) = typing.get_args(a) or (Any,)
            return item
    return None


def _without_path(message: str) -> str:
    """msgspec's message without its ' - at `$...`' suffix (the field says where)."""
    head, sep, _ = message.rpartition(" - at `$")
    return head if sep else message
