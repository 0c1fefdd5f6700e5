"""scripts/int8_block_probe.c (the block formats' ceiling in docs/KERNELS.md) builds and
prints its table on a CPU with AVX512-VNNI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sarazmq.kernels.native import cpu_has_flag

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "int8_block_probe.c"

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or not cpu_has_flag("avx512_vnni"),
    reason="the probe is AVX512-VNNI assembly, built with gcc",
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("probe") / "int8_block_probe"
    subprocess.run(["gcc", "-O3", "-march=native", "-o", str(exe), str(PROBE)], check=True)
    return exe


def test_probe_prints_the_rates_and_each_mix_ratio(probe: Path) -> None:
    out = subprocess.run([str(probe), "1"], capture_output=True, text=True, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "MAC" not in line]
    assert len(rows) == 3
    for row in rows:
        alone, q4_1, ratio, q4_0_ratio, row_scale_ratio = (
            float(cell) for cell in row.strip("| ").split(" | ")
        )
        assert alone > 0 and q4_1 > 0
        assert ratio == pytest.approx(q4_1 / alone, abs=0.01)
        # every mix adds work beside the multiply-adds: none can pass VPDPBUSD alone by
        # more than timing noise
        assert 0 < q4_0_ratio < 1.2 and 0 < row_scale_ratio < 1.2


def test_probe_refuses_a_round_count_under_one(probe: Path) -> None:
    done = subprocess.run([str(probe), "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "millions of rounds" in done.stderr
