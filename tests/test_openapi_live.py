"""schemathesis against a live server's /openapi.json: generated requests (valid and
invalid, every operation) get no 5xx, every error is in OpenAI's shape, every answer
matches the description, and the server is healthy afterwards."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from http_fixtures import API_KEY, MODEL, HTTPServer
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from sarazmq.api.openapi import OPERATIONS

pytestmark = [pytest.mark.model]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: output tokens a generated request may ask for: generations stay short on 2 cores
MAX_TOKENS = 4
#: generated requests per operation and mode (9 operations, 2 of them x 2 modes)
EXAMPLES = 12
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def server(http_server: HTTPServer) -> HTTPServer:
    return http_server  # shared by the HTTP modules (conftest.py)


def steer(body: Any) -> None:
    """Edits a generated body in place so that it reaches generation and stays short:
    any string "model" becomes the served one (else nearly every case would stop at the
    404 for an unknown model, which test_http_faults covers); an int max_tokens over
    MAX_TOKENS becomes MAX_TOKENS, and none at all (the chat default is the rest of the
    context) becomes MAX_TOKENS. Values of a wrong type stay as they are: invalid cases
    stay invalid."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    named = False
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            named = True
            if value > MAX_TOKENS:
                body[key] = MAX_TOKENS
        elif value is not None:
            named = True  # a wrong type: the server refuses it, nothing is generated
    if not named:
        body["max_tokens"] = MAX_TOKENS


@schemathesis.check
def openai_error_shape(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                       case: schemathesis.Case) -> bool | None:  # fmt: skip
    """Every 4xx/5xx is {"error": {"message", "type", "param", "code"}}, code = status."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] == response.status_code, err
    return None


def test_schemathesis_finds_no_server_error(server: HTTPServer) -> None:
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{server.root}/openapi.json")
    # the dashboard's event stream never ends by itself (tests/test_pages.py reads it)
    endless = {"GET /dashboard/events"}
    operations = [
        op for op in (r.ok() for r in schema.get_all_operations()) if op.label not in endless
    ]
    takes_body = {f"{op.method.upper()} {op.path}": op.body is not None for op in OPERATIONS}
    # schemathesis leaves out the operation serving the schema it was loaded from
    assert {op.label for op in operations} == set(takes_body) - {"GET /openapi.json"} - endless
    seen: dict[int, int] = {}

    for operation in operations:
        # without parameters or a body there is nothing to make invalid
        modes = [GenerationMode.POSITIVE]
        if takes_body[operation.label]:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @settings(
                max_examples=EXAMPLES,
                deadline=None,  # a request's time is bounded by the client's timeout
                derandomize=True,  # the same requests on every run: no flaky suite
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                steer(case.body)
                response = case.call(base_url=server.root, headers=AUTH, timeout=30)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                case.validate_response(
                    response, checks=CHECKS, additional_checks=[openai_error_shape],
                    headers=AUTH,
                )  # fmt: skip

            run()

    # both sides were exercised: successes and refusals
    assert seen.get(200) and seen.get(400), seen
    with httpx.Client(base_url=server.root, headers=AUTH, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    print(f"statuses {dict(sorted(seen.items()))} in {time.monotonic() - started:.1f} s")
