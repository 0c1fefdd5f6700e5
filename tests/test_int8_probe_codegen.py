"""The AVX2 int8 peak probe (int8_dot.c `probe_int8`, the "int8 limit" of
bench_engine.py --int8 on AVX2 machines) times what it says: 8 VPMADDUBSW a round, each
added into an accumulator held in a register.

Until 2026-12-07 every chain multiplied the same two vectors, so the compiler computed
the product once a round and kept some sums on the stack: the probe timed VPADDW and
store-reload chains (on a Zen 4 capped at AVX2 it read 1.4x VPMADDUBSW's real rate).
This reads the code GCC generates for the AVX2 build (x86-64-v3, the library's own
flags); it needs gcc, not an AVX2 CPU."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sarazmq.kernels import native
from sarazmq.kernels.native import compile_flags

SOURCE = Path(native.__file__).parent / "csrc" / "int8_dot.c"

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="reads the x86-64 code gcc generates",
)


@pytest.fixture(scope="module")
def probe_asm(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The instructions of the AVX2 build's probe_int8 (GCC may suffix its name)."""
    out = tmp_path_factory.mktemp("asm") / "int8_dot.s"
    flags = [f for f in compile_flags("avx2") if f != "-shared"]
    done = subprocess.run(
        ["gcc", *flags, "-S", "-o", str(out), "-I", str(SOURCE.parent), str(SOURCE)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:  # e.g. a GCC before 11, without -march=x86-64-v3
        pytest.skip(f"gcc cannot build the AVX2 library: {done.stderr[-300:]}")
    lines = out.read_text().splitlines()
    labels = (i for i, line in enumerate(lines) if re.match(r"_?probe_int8[.\w]*:$", line))
    start = next(labels, None)
    if start is None:
        pytest.fail("no probe_int8 function in the generated code")
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith(".size"))
    body = (line.strip() for line in lines[start:end] if line.startswith("\t"))
    return [line for line in body if not line.startswith(".")]  # not the directives


def test_every_chain_runs_its_own_vpmaddubsw(probe_asm: list[str]) -> None:
    ops = [line.split()[0] for line in probe_asm]
    assert ops.count("vpmaddubsw") == 8, "a product was computed once for several chains"
    assert ops.count("vpaddw") >= 8


def test_no_sum_goes_through_memory(probe_asm: list[str]) -> None:
    # an accumulator on the stack turns each chain into a store-reload chain
    sums_in_memory = [line for line in probe_asm if line.startswith("vpaddw") and "(%" in line]
    assert not sums_in_memory
