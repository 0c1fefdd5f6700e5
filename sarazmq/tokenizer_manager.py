"""Prompt validation, tokenization and chat templates (the frontend's logic, socket-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

VALID_ROLES = ("system", "user", "assistant", "tool")


class TokenizerManager:
    """Turns user prompts (text, token ids or chat messages) into validated token ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenizes text (with the tokenizer's own special-token rules) or checks token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}); got {bad[:5]!r}"
                )
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
            )
        self.check_length(ids)
        return ids

    def check_length(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room for output in the model's "
                f"context of {self.max_model_len} tokens"
            )

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Renders a conversation with the model's chat template, ready for the assistant's turn."""
        check_messages(messages)
        rendered = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        ids = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        self.check_length(ids)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Raises ValueError naming the first malformed message of a chat."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is not one of {VALID_ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
