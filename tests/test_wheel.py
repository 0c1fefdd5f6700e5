"""What users install is what is tested: the built wheel, installed non-editable into a
fresh virtual environment, runs the CLI, the simulator and an HTTP server.

The fresh environment gets its dependencies (torch, transformers, the default model...)
from this one's site-packages through a .pth file pointing at a view of it without
sarazmq, so nothing is downloaded and the only sarazmq it can import is the wheel's.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from import_graph import FOLDERS

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _expected_packages() -> set[str]:
    """Every package of the checkout (a folder with __init__.py), as installed."""
    out = set()
    for package, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            if package == "sarazmq" and rel and rel[0] in ("kernels", "procs"):
                continue
            out.add(".".join([package, *rel]))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("sarazmq-*.whl")
    return path


def test_the_wheel_holds_every_package_and_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {
        n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")
    }
    expected = _expected_packages()
    assert {"sarazmq.api", "sarazmq.perf", "sarazmq.sim", "sarazmq.sweep"} <= expected
    assert expected <= packages, expected - packages
    # every module of every package, and the data the code reads
    for package, folder in FOLDERS.items():
        for py in folder.rglob("*.py"):
            rel = py.relative_to(folder)
            if package == "sarazmq" and rel.parts[0] in ("kernels", "procs"):
                continue
            assert "/".join([*package.split("."), *rel.parts]) in names, rel
    for c_source in (ROOT / "kernels" / "csrc").iterdir():
        assert f"sarazmq/kernels/csrc/{c_source.name}" in names
    data = [n for n in names if n.endswith(".csv")]
    assert any(n.startswith("sarazmq/perf/data/vidur/") and n.endswith("mlp.csv") for n in data)
    assert "sarazmq/perf/data/vidur/data/profiling/a100/cpu_overheads.csv" in names
    assert "sarazmq/replay/data/azure_llm_2023_conv.csv" in names


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (not editable), its dependencies seen through
    a view of this environment's site-packages without sarazmq."""
    root = tmp_path_factory.mktemp("venv")
    env_dir = root / "venv"
    # no pip or setuptools of its own: every dependency comes from the view (this
    # environment's pip installs into it with --python)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    deps = root / "deps"
    deps.mkdir()
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            if "sarazmq" in entry.name or (deps / entry.name).exists():
                continue  # the editable install of the checkout stays out of sight
            (deps / entry.name).symlink_to(entry)
    py = env_dir / "bin" / "python"
    target = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(target) / "zz_dependencies.pth").write_text(str(deps) + "\n")
    # no --no-deps: pip checks that every requirement of the wheel is satisfied (by the
    # view), with no index to fetch a missing one from
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q",
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env_dir


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_installed_wheel_imports_from_the_venv(venv: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sarazmq, sarazmq.api, sarazmq.perf.gpu, sarazmq.sweep, sarazmq.kernels; "
         "print(sarazmq.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(venv)), proc.stdout


def test_installed_cli_help_and_simulate(venv: Path, tmp_path: Path) -> None:
    cli = str(venv / "bin" / "sarazmq")
    helped = subprocess.run([cli, "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env=_env(), timeout=120)  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    for command in ("serve", "simulate", "sweep", "profile", "replay"):
        assert command in helped.stdout
    out = tmp_path / "sim"
    simulated = subprocess.run(
        [cli, "simulate", "fixed", "--input-tokens", "64", "--output-tokens", "8",
         "--max-requests", "20", "--qps", "5", "--gpu", "a100", "--arch", "llama-2-7b",
         "--output-dir", str(out), "--no-plots"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300,
    )  # fmt: skip
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_completed"] == 20
    # the GPU tables came from the installed package, not a checkout
    assert summary["settings"]["latency_model"]["source"] == "vidur"


def test_installed_serve_answers_a_completion(venv: Path, tmp_path: Path) -> None:
    from sarazmq.procs.endpoints import free_tcp_port

    port = free_tcp_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [str(venv / "bin" / "sarazmq"), "serve", "--http-port", str(port),
             "--num-kv-blocks", "64", "--max-model-len", "512", "--threads", "1"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(),
            start_new_session=True,
        )  # fmt: skip
    try:
        body = json.dumps(
            {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
             "max_tokens": 4, "temperature": 0}
        ).encode()  # fmt: skip
        deadline = time.monotonic() + 240
        answer = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=60) as resp:
                    answer = json.loads(resp.read())
                break
            except OSError:
                time.sleep(1.0)
        assert answer is not None, log.read_text()
        assert answer["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == 4
        # the pages' assets ship in the wheel (package data), not only in the source tree
        for path, marker in (
            ("/dashboard", b"engine-template"),
            ("/chat", b"/static/chat.js"),
            ("/static/dashboard.js", b"drawChart"),
            ("/static/style.css", b"--prefill"),
        ):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
                assert marker in resp.read(), path
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
