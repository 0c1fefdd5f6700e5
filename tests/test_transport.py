"""Transport rules that need no model: non-blocking sends to clients, no pickle anywhere,
CurveZMQ key files, which public endpoints `serve` accepts."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from sarazmq.config import CurveKeys
from sarazmq.keys import create_keypair, load_keypair, load_public_key
from sarazmq.procs.endpoints import check_ipc_free, check_public_endpoint
from sarazmq.procs.frontend import ClientSender
from sarazmq.protocol.client import Heartbeat

ROOT = Path(__file__).resolve().parent.parent


def test_sends_to_a_client_that_does_not_read_never_block() -> None:
    """A full per-client queue (SNDHWM) or a vanished client is reported, never waited on."""

    async def main() -> tuple[list, list, int]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 8)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        await dealer.send(b"hello")
        identity, _ = await router.recv_multipart()
        sender = ClientSender(router)
        big = Heartbeat(time=0.0)
        gone: list = []
        sent = 0
        # the dealer never reads: its queues fill; each send returns at once
        while not gone and sent < 100_000:
            gone = await asyncio.wait_for(sender.send([(identity, big)] * 64), 1.0)
            sent += 64
        unknown = await sender.send([(b"\x00nobody", big)])
        ctx.destroy(linger=0)
        return gone, unknown, sent

    gone, unknown, sent = asyncio.run(main())
    assert gone and gone[0][1] == "backlog_full", (gone, sent)
    assert unknown == [(b"\x00nobody", "disconnected")]


BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
BANNED_CALLS = {"recv_pyobj", "send_pyobj", "loads", "load"}


def test_no_pickle_anywhere_in_the_package() -> None:
    """No module imports a pickle-family module, calls pyzmq's pickle helpers, or
    torch.load; and CI's ruff run enforces bandit's pickle rules."""
    offenders = []
    files = [p for d in ("sarazmq", "procs", "kernels") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Attribute) and node.attr in BANNED_CALLS:
                base = node.value
                is_torch = isinstance(base, ast.Name) and base.id == "torch"
                if node.attr.endswith("pyobj") or (is_torch and node.attr == "load"):
                    offenders.append(f"{path}:{node.lineno} .{node.attr}")
                continue
            else:
                continue
            offenders += [f"{path}:{node.lineno} import {n}" for n in names if n in BANNED_MODULES]
    assert offenders == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    select = pyproject.split("[tool.ruff.lint]", 1)[1].split("select = ", 1)[1].split("]")[0]
    assert '"S301"' in select and '"S302"' in select
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert 'ruff" check sarazmq kernels procs' in test_sh
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_key_files(tmp_path: Path) -> None:
    public_file, secret_file = create_keypair(tmp_path / "keys", "srv")
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert secret_file.stat().st_mode & 0o777 == 0o600
    public, secret = load_keypair(secret_file)
    assert load_public_key(public_file) == public == zmq.curve_public(secret)
    assert b"secret" not in public_file.read_bytes().split(b"curve")[1]
    with pytest.raises(FileExistsError):
        create_keypair(tmp_path / "keys", "srv")
    os.chmod(secret_file, 0o640)
    with pytest.raises(ValueError, match="readable by others"):
        load_keypair(secret_file)
    (tmp_path / "junk.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ValueError, match="no valid public key"):
        load_public_key(tmp_path / "junk.key")


@pytest.mark.parametrize(
    ("endpoint", "with_keys", "ok"),
    [
        ("ipc:///tmp/x.ipc", False, True),
        ("tcp://127.0.0.1:5555", False, True),
        ("tcp://localhost:5555", False, True),
        ("tcp://[::1]:5555", False, True),
        ("tcp://0.0.0.0:5555", False, False),
        ("tcp://10.1.2.3:5555", False, False),
        ("tcp://*:5555", False, False),
        ("tcp://eth0:5555", False, False),
        ("tcp://0.0.0.0:5555", True, True),
        ("udp://127.0.0.1:5555", True, False),
    ],
)
def test_public_endpoint_rules(endpoint: str, with_keys: bool, ok: bool) -> None:
    curve = CurveKeys(public="p" * 40, secret="s" * 40) if with_keys else None
    if ok:
        check_public_endpoint(endpoint, curve)
    else:
        with pytest.raises(ValueError):
            check_public_endpoint(endpoint, curve)


def test_an_ipc_endpoint_in_use_is_refused_and_a_stale_one_reused(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/public.ipc"
    ctx = zmq.Context()
    live = ctx.socket(zmq.ROUTER)
    live.bind(endpoint)
    try:
        with pytest.raises(ValueError, match="in use"):
            check_ipc_free(endpoint)
    finally:
        live.close(linger=0)
        ctx.term()
    # a socket file nobody listens on (a killed server's) is removed
    stale_path = tmp_path / "stale.ipc"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(stale_path))
    stale.close()  # the file stays, nobody listens
    assert stale_path.exists()
    check_ipc_free(f"ipc://{stale_path}")
    assert not stale_path.exists()
    check_ipc_free(f"ipc://{tmp_path}/never.ipc")  # absent: fine


_WAITER = r"""
import signal, sys, threading, time
import zmq
from sarazmq.procs.common import recv_interruptible

def stopped(signum, frame):
    print("stopped", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, stopped)
# a library thread (torch's OpenMP workers, the tokenizers' pool) that takes signals
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
# the main thread never takes SIGTERM: the kernel must give it to the other thread
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
sock = zmq.Context().socket(zmq.PULL)
sock.bind(sys.argv[1])
print("waiting", flush=True)
recv_interruptible(sock)
"""


def test_sigterm_taken_by_another_thread_still_stops_a_waiting_process(tmp_path: Path) -> None:
    # Workers and detokenizers wait for their next message with recv_interruptible: the
    # launcher's SIGTERM may land on a library thread, and a main thread parked in one
    # blocking recv never runs the handler. A plain recv hangs here nearly always, but not
    # always (CI once saw it stop), so only the helper's side is asserted: replacing it
    # with a plain recv makes this test time out and fail.
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAITER, f"ipc://{tmp_path}/w.ipc"],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0 and proc.stdout.read().strip() == "stopped"
    finally:
        proc.kill()
        proc.wait()
