"""The HTTP server's pieces without a deployment: body decoding, translation, error mapping,
overload refusal, bind policy."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from sarazmq.api.app import APIConfig, OpenAIServer
from sarazmq.api.encoding import decode_body
from sarazmq.api.errors import openai_param
from sarazmq.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_prompts,
    to_sampling_params,
)
from sarazmq.api.streams import api_error
from sarazmq.client import RequestError
from sarazmq.config import SchedulerConfig
from sarazmq.procs.endpoints import check_http_bind
from sarazmq.protocol.engine import AddRequest, OutputBatch
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import Scheduler, SchedulerActions, SchedulerService
from sarazmq.validation import InvalidRequestError


def test_bodies_decode_and_name_the_bad_field() -> None:
    body = decode_body(b'{"prompt": "hi", "max_tokens": 5, "whatever": 1}', CompletionRequest)
    assert body.prompt == "hi" and body.max_tokens == 5
    cases = [
        (b'{"prompt": "hi", "max_tokens": "x"}', "max_tokens"),
        (b'{"max_tokens": 3}', "prompt"),
        (
            b'{"prompt": "hi", "stream_options": {"include_usage": 3}}',
            "stream_options.include_usage",
        ),
        (b'{"prompt": "hi",', ""),
        (b'{"prompt": "\xff"}', ""),
    ]
    for raw, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            decode_body(raw, CompletionRequest)
        assert e.value.field == field, (raw, e.value)
    with pytest.raises(InvalidRequestError) as e:
        decode_body(b'{"messages": [{"content": "x"}]}', ChatCompletionRequest)
    assert e.value.field == "messages[0].role"


def test_sampling_translation() -> None:
    body = decode_body(
        b'{"prompt": "x", "temperature": 0, "top_k": 0, "stop": "END", "seed": 3}',
        CompletionRequest,
    )
    p = to_sampling_params(body, logprobs=None, default_max_tokens=16)
    assert p == SamplingParams(temperature=0, top_k=-1, stop=["END"], seed=3, max_tokens=16)
    for raw, field in (
        (b'{"prompt": "x", "n": 3}', "n"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "presence_penalty": 5}', "presence_penalty"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            to_sampling_params(decode_body(raw, CompletionRequest), logprobs=None,
                               default_max_tokens=16)  # fmt: skip
        assert e.value.field == field
    chat = decode_body(
        b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}',
        ChatCompletionRequest,
    )
    with pytest.raises(InvalidRequestError) as e:
        to_sampling_params(chat, logprobs=None, default_max_tokens=16)
    assert e.value.field == "max_completion_tokens"
    chat_lp = decode_body(
        b'{"messages": [], "logprobs": true, "top_logprobs": 30}', ChatCompletionRequest
    )
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        chat_logprobs(chat_lp)


def test_completion_prompt_shapes() -> None:
    assert completion_prompts("a") == ["a"]
    assert completion_prompts([1, 2]) == [[1, 2]]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "a"], [[1], "a"], [True, 1], [1, -1 + 2**64]):
        with pytest.raises(InvalidRequestError) as e:
            completion_prompts(bad)
        assert e.value.field == "prompt"


def test_engine_errors_map_to_http() -> None:
    assert openai_param("params.top_p", "prompt") == "top_p"
    assert openai_param("prompt_token_ids", "prompt") == "prompt"
    assert openai_param("messages[1].role", "messages") == "messages[1].role"
    assert openai_param("", "prompt") is None
    bad = api_error(RequestError("r", "prompt is empty", "prompt", "invalid_request"), "prompt")
    assert bad.status == 400 and bad.param == "prompt"
    busy = api_error(RequestError("r", "overloaded", "", "overloaded"), "prompt")
    assert busy.status == 503 and busy.headers["Retry-After"] == "1"
    dead = api_error(RequestError("r", "engine failed: worker died", "", "engine"), "prompt")
    assert dead.status == 503 and dead.type == "service_unavailable"


def test_scheduler_refuses_requests_past_max_waiting() -> None:
    sched = Scheduler(
        SchedulerConfig(max_waiting=2), block_size=16, num_blocks=64, max_model_len=128,
        eos_token_ids=(),
    )  # fmt: skip
    service = SchedulerService(sched, num_detokenizers=1)
    replies = []
    for i in range(3):
        acts = SchedulerActions()
        service.on_inbound(AddRequest(f"r{i}", [1, 2, 3], SamplingParams(), 0.0), acts)
        replies.extend(d for m in acts.to_frontend if isinstance(m, OutputBatch) for d in m.outputs)
    assert len(sched.waiting) == 2
    (refused,) = replies
    assert refused.request_id == "r2" and refused.error_type == "overloaded"
    assert "max_waiting=2" in refused.error
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=-1)


def test_http_bind_policy() -> None:
    check_http_bind("127.0.0.1", None)
    check_http_bind("localhost", None)
    check_http_bind("0.0.0.0", "key")
    with pytest.raises(ValueError, match="without an API key"):
        check_http_bind("0.0.0.0", None)
    with pytest.raises(ValueError, match="without an API key"):
        check_http_bind("::", "")


def test_wrong_method_is_405_with_allow_and_openai_shape() -> None:
    # found by schemathesis (tests/test_openapi_live.py): the 405 lost Starlette's Allow
    # header, which RFC 9110 requires; TestClient outside `with` runs no lifespan, so no
    # engine is needed
    config = APIConfig(endpoint="tcp://127.0.0.1:1", model_name="m", max_model_len=64)
    client = TestClient(OpenAIServer(config, str).app())
    r = client.request("TRACE", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"] == {
        "message": "method not allowed: TRACE /v1/completions",
        "type": "not_found_error",
        "param": None,
        "code": 405,
    }
    r = client.delete("/health")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    assert client.get("/nowhere").status_code == 404
