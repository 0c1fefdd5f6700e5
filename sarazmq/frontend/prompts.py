"""Prompts to validated token ids: tokenization and chat templates (the frontend's, socket-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sarazmq.validation import (
    EMPTY_PROMPT,
    InvalidRequestError,
    check_messages,
    check_prompt_token_ids,
)


class PromptTokenizer:
    """Turns user prompts (text, token ids or chat messages) into validated token ids.

    Every rejection is an `InvalidRequestError` naming the field: "prompt" for text,
    "prompt_token_ids" for ids, "messages[i]..." for a chat.
    max_kv_tokens: token slots of the whole KV pool (a prompt must fit it), if known.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        max_kv_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_kv_tokens = max_kv_tokens

    def encode(self, prompt: str | Sequence[int], field: str | None = None) -> list[int]:
        """Tokenizes text (with the tokenizer's own special-token rules) or checks token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(EMPTY_PROMPT, field or "prompt")
            ids = list(self.tokenizer(prompt)["input_ids"])
            return self.check(ids, field or "prompt")
        return self.check(prompt, field or "prompt_token_ids")

    def check(self, token_ids: Sequence[Any], field: str = "prompt_token_ids") -> list[int]:
        """Validated token ids (see `check_prompt_token_ids`)."""
        return check_prompt_token_ids(
            token_ids,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_kv_tokens=self.max_kv_tokens,
            field=field,
        )

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Renders a conversation with the model's chat template, ready for the assistant's turn."""
        check_messages(messages)
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # noqa: BLE001 - the template's own checks (raise_exception)
            # templates refuse conversations they were not written for (roles that do
            # not alternate, a system message where none is allowed): the sender's error
            raise InvalidRequestError(
                f"the model's chat template refused the conversation: {e}", "messages"
            ) from e
        ids = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return self.check(ids, "messages")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
