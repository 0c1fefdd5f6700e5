"""HTTP errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import Response

from sarazmq.api.encoding import json_response
from sarazmq.validation import InvalidRequestError

# GenerateRequest field (from the engine) -> the OpenAI parameter it came from
_ENGINE_TO_OPENAI = {"prompt_token_ids": "prompt", "params.logprobs": "logprobs"}


class APIError(Exception):
    """An HTTP error response: status, OpenAI error type, message, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}

    @classmethod
    def invalid(cls, err: InvalidRequestError) -> APIError:
        return cls(400, err.message, param=err.field or None)

    def response(self) -> Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }
        return json_response(body, status=self.status, headers=self.headers)


def openai_param(engine_field: str, prompt_param: str) -> str | None:
    """The OpenAI parameter an engine-side field error is about ("params.top_p" ->
    "top_p"; the prompt's fields -> `prompt_param`, "prompt" or "messages")."""
    if not engine_field:
        return None
    if engine_field in ("prompt", "prompt_token_ids", "messages"):
        return prompt_param
    if engine_field in _ENGINE_TO_OPENAI:
        return _ENGINE_TO_OPENAI[engine_field]
    return engine_field.removeprefix("params.")
