"""The OpenAPI description without a deployment: a valid OpenAPI 3.1 document, every route
of the app in it and nothing else, and request bodies it accepts decoded by the server's
structs (and bodies it refuses refused by them)."""

from __future__ import annotations

from typing import Any

import jsonschema
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from starlette.routing import Route
from starlette.testclient import TestClient

from sarazmq.api.app import APIConfig, OpenAIServer
from sarazmq.api.encoding import decode_body
from sarazmq.api.openapi import BEARER_SCHEME, OPERATIONS, openapi_document
from sarazmq.api.schemas import ChatCompletionRequest, CompletionRequest
from sarazmq.validation import InvalidRequestError

CONFIG = APIConfig(endpoint="tcp://127.0.0.1:1", model_name="m", max_model_len=64, api_key="k")
BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def document(bearer: bool = True) -> dict[str, Any]:
    return openapi_document(model_name="m", max_model_len=64, bearer=bearer)


def test_the_document_is_valid_openapi_3_1() -> None:
    for bearer in (True, False):
        doc = document(bearer)
        assert doc["openapi"].startswith("3.1")
        validate(doc)  # raises OpenAPIValidationError on any violation of the 3.1 schema


def test_every_route_is_documented_and_nothing_else() -> None:
    app = OpenAIServer(CONFIG, str).app()
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"  # Starlette adds HEAD to every GET route
    }
    documented = {(path, method) for path, item in document()["paths"].items() for method in item}
    assert served == documented
    assert len(served) == len(OPERATIONS)


def test_bearer_only_on_data_routes_and_only_with_a_key() -> None:
    with_key, open_ = document(True), document(False)
    assert with_key["components"]["securitySchemes"][BEARER_SCHEME]["scheme"] == "bearer"
    assert "securitySchemes" not in open_["components"]
    for path, item in with_key["paths"].items():
        needs_key = path.startswith(("/v1/", "/dashboard/"))  # the pages' data, not the pages
        for op in item.values():
            assert (op["security"] == [{BEARER_SCHEME: []}]) == needs_key, path
            assert ("401" in op["responses"]) == needs_key, path
    for item in open_["paths"].values():
        for op in item.values():
            assert op["security"] == [] and "401" not in op["responses"]


def test_request_bodies_are_the_decoded_structs() -> None:
    doc = document()
    schemas = doc["components"]["schemas"]
    for path, struct in BODIES.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": f"#/components/schemas/{struct.__name__}"}
        # every field of the struct, and the required ones exactly
        fields = msgspec.structs.fields(struct)
        assert set(schemas[struct.__name__]["properties"]) == {f.encode_name for f in fields}
        required = {f.encode_name for f in fields if f.required}
        assert set(schemas[struct.__name__]["required"]) == required
        assert required  # "prompt" / "messages": a body without them is refused


def test_served_without_a_key() -> None:
    # outside the `with` block TestClient runs no lifespan: no engine is needed
    client = TestClient(OpenAIServer(CONFIG, str).app())
    r = client.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == document(bearer=True)
    assert client.get("/v1/models").status_code == 401  # /v1/ itself still needs it


def _validator(struct: type[msgspec.Struct]) -> jsonschema.Draft202012Validator:
    """The struct's schema as the document states it, with its components resolvable."""
    doc = document()
    schema = {"$ref": f"#/components/schemas/{struct.__name__}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schema_and_struct_agree_on_bodies(path: str, mode: GenerationMode) -> None:
    struct = BODIES[path]
    validator = _validator(struct)
    operation = schemathesis.openapi.from_dict(document())[path]["POST"]

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,  # the same bodies on every run: no flaky suite
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        # negative mode also sends raw bytes that are not JSON at all
        raw = case.body if isinstance(case.body, bytes) else msgspec.json.encode(case.body)
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            with pytest.raises(InvalidRequestError):
                decode_body(raw, struct)
            return
        if validator.is_valid(value):
            # the schema accepts it: the server's struct must decode it
            assert isinstance(decode_body(raw, struct), struct)
        else:
            # the schema refuses it: the server refuses it too
            with pytest.raises(InvalidRequestError):
                decode_body(raw, struct)

    check()
