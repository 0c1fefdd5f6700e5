"""`sarazmq chat` driven in a pseudo-terminal: two turns, the second depends on the first."""

from __future__ import annotations

import os
import subprocess
import sys

import pexpect
import psutil
import pytest
from proc_utils import alive as _alive

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _deployment_of(pid: int) -> tuple[list[int], set[str]]:
    """The sarazmq processes under `pid` and the run directories their ipc sockets are in."""
    procs, rundirs = [], set()
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "sarazmq.procs." not in " ".join(p.cmdline()):
                continue
            procs.append(p.pid)
            for conn in p.net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and "/sarazmq-" in conn.laddr:
                    rundirs.add(os.path.dirname(conn.laddr))
        except psutil.NoSuchProcess:
            continue
    return procs, rundirs


def test_chat_two_turns_in_a_pty() -> None:
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "sarazmq.cli",
            "chat",
            "--max-tokens",
            "48",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "1024",
        ],
        encoding="utf-8",
        timeout=240,
    )
    try:
        child.expect("chat ready")
        child.expect("you> ")
        procs, rundirs = _deployment_of(child.pid)
        assert len(procs) == 4, procs
        child.sendline("Let us talk about the Eiffel Tower.")
        child.expect("assistant> ")
        child.expect("you> ")
        first = child.before
        # "it" is only resolvable from the first turn
        child.sendline("In which city is it?")
        child.expect("assistant> ")
        child.expect("you> ")
        second = child.before
        assert "paris" in second.lower(), (first, second)
        # /reset clears the history: the same question no longer knows what "it" is
        child.sendline("/reset")
        child.expect("history cleared")
        child.expect("you> ")
        child.sendline("In which city is it?")
        child.expect("assistant> ")
        child.expect("you> ")
        third = child.before
        assert "paris" not in third.lower(), (second, third)
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    # the deployment it started is gone: no process of it, no run directory
    assert _alive(procs) == [], procs
    assert rundirs and not any(os.path.exists(d) for d in rundirs)


@pytest.mark.parametrize("extra", [[], ["--enforce-eager"]])
def test_generate_command_streams_an_answer(extra: list[str]) -> None:
    # the console script installed beside this interpreter (the venv's bin/ may not be on PATH)
    script = os.path.join(os.path.dirname(sys.executable), "sarazmq")
    assert os.path.exists(script), "the sarazmq console script is not installed"
    out = subprocess.run(
        [
            script,
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "16",
            "--num-kv-blocks",
            "128",
            "--max-model-len",
            "512",
            # the float path: its first token leads "Paris" by 0.08 nats, which int8's
            # roundings can flip (tests/test_int8_dot_model.py bounds those)
            "--gguf-matmul",
            "float",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
