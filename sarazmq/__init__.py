"""sarazmq: a Sarathi-Serve style LLM serving engine (chunked prefills, stall-free hybrid
batches) built as actor processes over ZeroMQ and msgspec.

Heavy modules (torch, transformers) load lazily, so the client SDK imports fast and
does not need torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from sarazmq.outputs import RequestOutput
from sarazmq.sampling_params import SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "sarazmq.engine",
    "LLMEngine": "sarazmq.engine",
    "Client": "sarazmq.client",
    "AsyncClient": "sarazmq.client",
    "EngineError": "sarazmq.client",
    "RequestError": "sarazmq.client",
    "HealthReport": "sarazmq.client",
}

__all__ = ["SamplingParams", "RequestOutput", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sarazmq' has no attribute {name!r}")
    return getattr(import_module(module), name)
