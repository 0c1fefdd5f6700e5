"""`sarazmq chat` driven in a pseudo-terminal: two turns, the second depends on the first."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pexpect
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_chat_two_turns_in_a_pty() -> None:
    before = subprocess.run(["pgrep", "-f", "sarazmq.procs"], capture_output=True, text=True).stdout
    child = pexpect.spawn(
        sys.executable,
        ["-m", "sarazmq.cli", "chat", "--max-tokens", "48", "--num-kv-blocks", "256",
         "--max-model-len", "1024"],
        encoding="utf-8",
        timeout=240,
    )
    try:
        child.expect("chat ready")
        child.expect("you> ")
        child.sendline("My favourite colour is green. Reply with just OK.")
        child.expect("assistant> ")
        child.expect("you> ")
        first = child.before
        child.sendline("What is my favourite colour? Answer with one word.")
        child.expect("assistant> ")
        child.expect("you> ")
        second = child.before
        assert "green" in second.lower(), (first, second)
        # /reset clears the history: the colour is gone
        child.sendline("/reset")
        child.expect("history cleared")
        child.expect("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    after = subprocess.run(["pgrep", "-f", "sarazmq.procs"], capture_output=True, text=True).stdout
    assert set(after.split()) <= set(before.split())


@pytest.mark.skipif(shutil.which("sarazmq") is None, reason="console script not installed")
def test_generate_command_streams_an_answer() -> None:
    out = subprocess.run(
        ["sarazmq", "generate", "What is the capital of France?", "--max-tokens", "16",
         "--num-kv-blocks", "128", "--max-model-len", "512"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
