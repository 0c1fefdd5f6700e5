"""What every process of a deployment shares: its spec (msgpack on stdin), signals, READY.

A child is started as `python -m sarazmq.procs.<kind>` and reads its `ProcSpec` as
msgpack from stdin: config crosses to children with msgspec, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable

import msgspec
import zmq

from sarazmq.config import DeploymentConfig, EngineConfig, ModelConfig
from sarazmq.procs.endpoints import Endpoints, InstanceEndpoints
from sarazmq.procs.sockets import push_socket
from sarazmq.protocol.launcher import Failed, Ready

#: the process kinds that belong to one engine instance (the others serve them all)
INSTANCE_KINDS = ("scheduler", "worker", "detokenizer")


class ProcSpec(msgspec.Struct):
    """Everything a child process needs, sent to it as msgpack on stdin.

    instance: the engine instance a scheduler, worker or detokenizer belongs to (its
    sockets are `endpoints.instances[instance]`)."""

    kind: str
    index: int
    config: EngineConfig
    model_config: ModelConfig
    deployment: DeploymentConfig
    endpoints: Endpoints
    instance: int = 0

    @property
    def name(self) -> str:
        """The process's name in logs, READY and failure messages: "worker-1", or with
        several instances "replica2-worker-1"."""
        if self.config.num_instances > 1 and self.kind in INSTANCE_KINDS:
            role = self.config.instance_role(self.instance)
            prefix = "replica" if role == "mixed" else role
            return f"{prefix}{self.instance}-{self.kind}-{self.index}"
        return f"{self.kind}-{self.index}"

    @property
    def own(self) -> InstanceEndpoints:
        """The sockets of this process's instance."""
        return self.endpoints.instances[self.instance]


class Stopped(BaseException):
    """Raised by the SIGTERM handler: the process exits 0 (the launcher asked it to)."""


def read_spec() -> ProcSpec:
    return msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ProcSpec)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send `sig` to this process when the launcher dies (no orphans)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    if os.getppid() == 1:
        os._exit(1)


def remove_deployment_files(spec: ProcSpec) -> None:
    """Removes the run directory and the public ipc file (the launcher's job, when the
    launcher itself was killed)."""
    shutil.rmtree(os.path.dirname(spec.endpoints.launcher[len("ipc://") :]), ignore_errors=True)
    if spec.endpoints.public.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(spec.endpoints.public[len("ipc://") :])


# how often a process waiting for its next message returns to Python (see recv_interruptible)
SIGNAL_CHECK_MS = 200


def recv_interruptible(sock: zmq.Socket) -> bytes:
    """The socket's next message, waiting in slices of SIGNAL_CHECK_MS.

    The kernel may deliver the launcher's SIGTERM to any thread that does not block it:
    torch's OpenMP workers, the tokenizers' thread pool. Python then runs the handler
    (`Stopped`) only when the main thread next runs Python code, and a main thread parked
    in one blocking recv on an idle socket never does: the process ignored SIGTERM until
    the launcher killed it. Waking every slice runs the pending handler.
    """
    while not sock.poll(SIGNAL_CHECK_MS):
        pass
    return sock.recv()


def run_process(body: Callable[[ProcSpec, zmq.Context, Callable[..., None]], None]) -> None:
    """Common main: spec, logging, signals, READY/Failed reporting around `body`.

    body(spec, ctx, ready) must call ready(**info) once it serves.
    """
    spec = read_spec()
    name = spec.name
    if spec.kind == "frontend":
        # The frontend never blocks for long (it runs no model), so it can take a
        # catchable signal when the launcher dies, and clean up the files the launcher
        # no longer can; every other child is SIGKILLed.
        def orphaned(signum: int, frame: object) -> None:
            remove_deployment_files(spec)
            os._exit(1)

        signal.signal(signal.SIGHUP, orphaned)
        die_with_parent(signal.SIGHUP)
    else:
        die_with_parent()
    # every file this process creates (ipc sockets) is owner-only from the start
    os.umask(0o077)
    # Ctrl-C reaches the whole process group; only the launcher decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_stopped)
    logging.basicConfig(
        level=spec.deployment.log_level, format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    ctx = zmq.Context()
    launcher = push_socket(ctx, spec.endpoints.launcher)
    enc = msgspec.msgpack.Encoder()

    def ready(**info: object) -> None:
        launcher.send(enc.encode(Ready(name=name, pid=os.getpid(), info=dict(info))))

    try:
        body(spec, ctx, ready)
    except Stopped:
        ctx.destroy(linger=0)
        # nothing is left to flush but the logs; skip the interpreter's (and torch's)
        # slow teardown, which on a loaded machine can outlast the launcher's patience
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except Exception as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        logging.getLogger(name).error("%s failed: %s", name, traceback.format_exc())
        launcher.send(enc.encode(Failed(name=name, error=f"{type(e).__name__}: {e}")))
        launcher.close(linger=2000)
        ctx.destroy(linger=0)
        sys.exit(1)
    launcher.close(linger=1000)
    ctx.destroy(linger=0)


def async_body(
    serve: Callable[[ProcSpec, Callable[..., None]], Awaitable[None]],
) -> Callable[[ProcSpec, zmq.Context, Callable[..., None]], None]:
    """A `run_process` body that runs `serve(spec, ready)` on uvloop (asyncio where it is
    missing); `serve` cancelling itself (its SIGTERM handler) is a requested stop."""

    def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            runner = asyncio.run
        try:
            runner(serve(spec, ready))
        except asyncio.CancelledError:
            raise Stopped from None

    return body


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped
