"""SARAZMQ_CPU_ISA: the instruction-set cap that runs the AVX2 (and AVX-512-without-AMX)
code paths on a bigger CPU, so they are tested wherever the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sarazmq.kernels.native import (
    CPU_ISA_ENV,
    CpuIsaError,
    check_cpu_isa_cap,
    cpu_has_flag,
    cpu_isa_cap,
    visible_cpu_flags,
)

SAPPHIRE_RAPIDS = "fpu sse2 avx avx2 fma bmi2 f16c movbe avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16 avx_vnni".split()  # noqa: E501
ZEN3 = "fpu sse2 avx avx2 fma bmi2 f16c movbe".split()
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# caps ours and torch's kernels alike
CPU_ISA_SH = os.path.join(os.path.dirname(TESTS_DIR), "scripts", "cpu_isa.sh")


def test_caps_hide_the_flags_above_them() -> None:
    native = visible_cpu_flags(SAPPHIRE_RAPIDS, "native")
    assert native == set(SAPPHIRE_RAPIDS)
    avx512 = visible_cpu_flags(SAPPHIRE_RAPIDS, "avx512")
    assert {"avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"} <= avx512
    assert not any(f.startswith("amx") for f in avx512)
    avx2 = visible_cpu_flags(SAPPHIRE_RAPIDS, "avx2")
    assert avx2 == set(ZEN3)  # what x86-64-v3 code may use: no AVX-512, AMX, AVX-VNNI


def test_cap_names_are_checked_against_the_cpu() -> None:
    assert check_cpu_isa_cap("", ZEN3) == "native"
    assert check_cpu_isa_cap(" AVX2 ", ZEN3) == "avx2"
    assert check_cpu_isa_cap("avx512", SAPPHIRE_RAPIDS) == "avx512"
    with pytest.raises(CpuIsaError, match="'avx3' is not an instruction-set cap.*avx2"):
        check_cpu_isa_cap("avx3", SAPPHIRE_RAPIDS)
    # code built for a cap the CPU lacks would fault: refused, naming what is missing
    with pytest.raises(CpuIsaError, match="avx512 needs a CPU with avx512f"):
        check_cpu_isa_cap("avx512", ZEN3)
    with pytest.raises(CpuIsaError, match="avx2 needs a CPU with avx2, fma"):
        check_cpu_isa_cap("avx2", ["fpu", "sse2", "bmi2", "f16c", "movbe"])


def test_the_environment_sets_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_ISA_ENV, raising=False)
    assert cpu_isa_cap() == "native"
    monkeypatch.setenv(CPU_ISA_ENV, "avx4")
    with pytest.raises(CpuIsaError, match="avx4"):
        cpu_has_flag("avx2")


def test_a_bad_cap_is_a_one_line_cli_error() -> None:
    from sarazmq.cli import main

    args = ["generate", "hi", "--model", "smollm2-135m", "--load-format", "dummy"]
    result = CliRunner().invoke(main, args, env={CPU_ISA_ENV: "avx4"})
    assert result.exit_code == 1 and "Traceback" not in result.output
    # the error is one line, before any process started
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert errors == [
        "Error: SARAZMQ_CPU_ISA='avx4' is not an instruction-set cap; expected one of "
        "native, avx512, avx2"
    ]


# a CPU with AVX-512 builds none of the AVX2-only kernels (gemv_avx2.c,
# decode_attention_avx2.c, prefill_attention_f32.c's 8 lanes, the VPMADDUBSW int8 panels); under
# the avx2 cap they are built and run against their references
_AVX2_CHECK = """
import torch
from sarazmq.kernels.int8_dot import int8_dot_avx2, int8_dot_vnni
from sarazmq.kernels.native import cpu_has_flag
from sarazmq.resolve import resolve_gguf_matmul
print("flags", cpu_has_flag("avx2"), cpu_has_flag("avx512f"), cpu_has_flag("amx_bf16"))
print("int8", int8_dot_avx2(), int8_dot_vnni())
print("auto", resolve_gguf_matmul("auto", "gguf", "cpu", "float32"))
print("aten", torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and cpu_has_flag("avx512f")),
    reason="the CPU has no AVX-512: the whole suite runs the AVX2 paths already",
)
def test_avx2_kernels_under_the_cap_match_their_references() -> None:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.pop(CPU_ISA_ENV, None)
    capped = ["bash", CPU_ISA_SH, "avx2", sys.executable]
    probe = subprocess.run(capped + ["-c", _AVX2_CHECK], env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    # x86-64-v3 has no VNNI: the int8 panels take VPMADDUBSW, and auto picks them
    assert "flags True False False" in probe.stdout
    assert "int8 True False" in probe.stdout
    assert "auto int8" in probe.stdout
    assert "aten AVX2" in probe.stdout  # torch capped by the script too
    # "native" lifts a cap the environment already had
    env[CPU_ISA_ENV] = "avx2"
    lifted = subprocess.run(
        ["bash", CPU_ISA_SH, "native", sys.executable, "-c", _AVX2_CHECK],
        env=env,
        capture_output=True,
        text=True,
    )
    assert "flags True True" in lifted.stdout, lifted.stderr[-2000:]
    del env[CPU_ISA_ENV]
    files = [
        "test_int8_dot.py",
        "test_act_quant.py",  # the fused producers on the one-block AVX2 quantizer
        "test_int8_panels.py",
        "test_int8_decode_step.py",
        "test_prefill_f32.py",
        "test_decode_step.py",
        "test_hybrid_step_int8.py",  # the one-call iteration on VPMADDUBSW panels
        "test_int8_dot_model.py",  # the real model on the VPMADDUBSW panels, against float
    ]
    run = subprocess.run(
        capped
        + ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + [os.path.join(TESTS_DIR, f) for f in files],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(TESTS_DIR),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # the AVX2 int8 decode step ran, not skipped for want of its kernel
    assert "the AVX2 int8 kernels are not built" not in run.stdout, run.stdout[-3000:]
