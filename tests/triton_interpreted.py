"""Triton kernel modules imported under Triton's CPU interpreter, for the tests that run
them without a GPU.

TRITON_INTERPRET=1 is read when triton and a kernels module are first imported (each
@triton.jit decides then whether it compiles or interprets), so it is set around those
imports and put back after, leaving other test modules the machine as it is; the tests
set it again while they run (their `_interpreter` fixtures).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def interpreted_kernels(*names: str) -> list[ModuleType]:
    """The modules `sarazmq.kernels.<name>`, imported under the interpreter. Skips the
    calling test module where triton is missing, or where a module was imported for a
    GPU earlier in this process (its `INTERPRETED` is False)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        modules = [importlib.import_module(f"sarazmq.kernels.{name}") for name in names]
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before
    if not all(m.INTERPRETED for m in modules):
        pytest.skip(
            "the Triton kernels were built for a GPU in this process", allow_module_level=True
        )
    return modules
