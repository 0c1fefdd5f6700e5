"""Fixtures more than one test module uses, built once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_fixtures import HTTPServer, start_http_server


@pytest.fixture(scope="session")
def http_server() -> Iterator[HTTPServer]:
    """One deployment serving the OpenAI HTTP API (and the pages) for every HTTP test
    module: test_http, test_http_faults, test_openapi_live, test_pages. Starting one
    takes 20-60 s on two cores; none of these modules stops or breaks it."""
    yield from start_http_server()
