"""What every process of a deployment shares: its spec (msgpack on stdin), sockets, READY.

A child is started as `python -m sarazmq.procs.<kind>` and reads its `ProcSpec` as
msgpack from stdin: config crosses to children with msgspec, never pickle.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable

import msgspec
import zmq

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.protocol import Failed, Ready


class Endpoints(msgspec.Struct):
    """Every socket address of one deployment; each PULL is bound by its owner."""

    public: str
    scheduler_in: str
    frontend_in: str
    worker_plans: list[str]
    worker_result: str
    detokenizers: list[str]
    launcher: str
    dist_init: str


class CurveKeys(msgspec.Struct):
    """The server's CurveZMQ keypair (z85), when the public endpoint requires it."""

    public: str
    secret: str


class ProcSpec(msgspec.Struct):
    kind: str
    index: int
    config: EngineConfig
    model_config: ModelConfig
    endpoints: Endpoints
    num_detokenizers: int
    curve: CurveKeys | None = None
    log_level: str = "WARNING"


def read_spec() -> ProcSpec:
    return msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ProcSpec)


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when the launcher dies (no orphans)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    return sock


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def run_process(body: Callable[[ProcSpec, zmq.Context, Callable[..., None]], None]) -> None:
    """Common main: spec, logging, signals, READY/Failed reporting around `body`.

    body(spec, ctx, ready) must call ready(**info) once it serves.
    """
    spec = read_spec()
    name = f"{spec.kind}-{spec.index}"
    die_with_parent()
    # Ctrl-C reaches the whole process group; only the launcher decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    ctx = zmq.Context()
    launcher = push_socket(ctx, spec.endpoints.launcher)
    enc = msgspec.msgpack.Encoder()

    def ready(**info: object) -> None:
        launcher.send(enc.encode(Ready(name=name, pid=os.getpid(), info=dict(info))))

    try:
        body(spec, ctx, ready)
    except Exception as e:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        logging.getLogger(name).error("%s failed: %s", name, traceback.format_exc())
        launcher.send(enc.encode(Failed(name=name, error=f"{type(e).__name__}: {e}")))
        launcher.close(linger=2000)
        ctx.term()
        sys.exit(1)
    launcher.close(linger=1000)
    ctx.term()
