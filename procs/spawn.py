"""Starting a deployment's processes and waiting for each one's READY.

Children are plain subprocesses (`python -m sarazmq.procs.<kind>`) that read their spec as
msgpack from stdin: no pickle, no fork of a process holding torch threads.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from sarazmq.procs.common import INSTANCE_KINDS, ProcSpec
from sarazmq.protocol.launcher import Drained, Failed, LauncherInbound, Ready

log = logging.getLogger("sarazmq.launcher")


class DeploymentError(RuntimeError):
    """The deployment could not start, or a process of it died."""


@dataclass
class Child:
    """A started process; instance: the engine instance it belongs to (None: it serves
    every instance, as the frontend does)."""

    name: str
    popen: subprocess.Popen[bytes]
    instance: int | None = None


def child_environment(threads: int) -> dict[str, str]:
    """The environment of a child process: this one's, with `threads` OpenMP threads and
    PYTHONSAFEPATH=1. `python -m` would otherwise put the working directory first on
    sys.path, and started from a source checkout its top-level kernels/ (installed as
    sarazmq.kernels) would shadow Hugging Face's `kernels` package, which transformers
    imports when that package is installed."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def spawn_child(spec: ProcSpec, threads: int) -> Child:
    """Starts one child with its spec on stdin and `threads` OpenMP threads."""
    env = child_environment(threads)
    log_file = spec.deployment.log_file
    out = open(log_file, "ab") if log_file else None  # noqa: SIM115 - the child keeps its own fd
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", f"sarazmq.procs.{spec.kind}"],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=env,
        )
    finally:
        if out is not None:
            out.close()
    if popen.stdin is None:  # stdin=PIPE always gives one; typed as optional
        raise DeploymentError(f"{spec.name}: no stdin pipe to send its spec")
    popen.stdin.write(msgspec.msgpack.encode(spec))
    popen.stdin.close()
    return Child(spec.name, popen, spec.instance if spec.kind in INSTANCE_KINDS else None)


def decode_launcher_message(
    decoder: msgspec.msgpack.Decoder, frame: bytes
) -> LauncherInbound | None:
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.error("undecodable message to the launcher: %s", e)
        return None


def await_ready(
    launcher: zmq.Socket,
    children: list[Child],
    timeout: float,
    stop_requested: threading.Event,
    on_message: Callable[[LauncherInbound], None] | None = None,
) -> None:
    """Returns once every child said READY; raises DeploymentError naming the first one
    that failed to start (its own reason when it sent one), exited, or timed out.

    on_message: called with every other message; it may append to `children` (they are
    then waited for too)."""
    decoder = msgspec.msgpack.Decoder(LauncherInbound)
    ready: set[str] = set()
    deadline = time.monotonic() + timeout
    # a Failed of another process (say another replica's, while one restarts) is not
    # this start's: it goes to on_message, and that process's death to its supervisor
    while waiting := (names := {c.name for c in children}) - ready:
        if time.monotonic() > deadline:
            raise DeploymentError(f"timed out waiting for {sorted(waiting)} to become ready")
        if stop_requested.is_set():  # e.g. Ctrl-C during a long model load
            raise DeploymentError("stopped while starting")
        if launcher.poll(200):
            msg = decode_launcher_message(decoder, launcher.recv())
            if isinstance(msg, Failed) and msg.name in names:
                raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
            if isinstance(msg, Ready):
                ready.add(msg.name)
            elif msg is not None and on_message is not None:
                on_message(msg)
            continue
        for child in children:
            code = child.popen.poll()
            if code is not None:
                # a Failed message may still be queued: it names the cause better
                if launcher.poll(500):
                    msg = decode_launcher_message(decoder, launcher.recv())
                    if isinstance(msg, Failed):
                        raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
                raise DeploymentError(f"{child.name} exited with code {code} during start")


def stop_children(children: list[Child], grace_s: float = 5.0) -> dict[str, int]:
    """SIGTERM to every live child, SIGKILL for those still alive after `grace_s`;
    returns each child's exit code."""
    for child in children:
        if child.popen.poll() is None:
            child.popen.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop on SIGTERM; killing it", child.name)
            child.popen.kill()
            child.popen.wait()
    return {c.name: c.popen.returncode for c in children}


def await_drained(
    launcher: zmq.Socket,
    decoder: msgspec.msgpack.Decoder,
    timeout: float,
    dead_child: Callable[[], Child | None],
) -> Drained | None:
    """Waits (bounded) for the frontend's `Drained` after a `Drain(timeout)`; None when it
    does not come in time or a child dies meanwhile."""
    # past its deadline the frontend aborts what is left; give the aborts time to return
    deadline = time.monotonic() + timeout + 5.0
    while time.monotonic() < deadline and dead_child() is None:
        if launcher.poll(100):
            msg = decode_launcher_message(decoder, launcher.recv())
            if isinstance(msg, Drained):
                time.sleep(0.2)  # the last replies are on their way out of the frontend
                return msg
    log.error("the deployment did not drain in time; stopping it anyway")
    return None
