"""Launcher / supervisor: starts every process, waits for READY, watches them, tears down.

Children are plain subprocesses (`python -m sarazmq.procs.<kind>`) that read their spec
as msgpack from stdin: no pickle, no fork of a process holding torch threads. Internal
sockets are ipc files in a private 0700 directory that the launcher removes at exit.
If any child dies, the frontend is told to fail every in-flight request
(`EngineDead`), then everything is stopped and the launcher reports failure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from sarazmq.config import EngineConfig
from sarazmq.procs.common import CurveKeys, Endpoints, ProcSpec
from sarazmq.protocol import EngineDead, Failed, LauncherInbound, Ready
from sarazmq.resolve import resolve_engine_config

log = logging.getLogger("sarazmq.launcher")


class DeploymentError(RuntimeError):
    """The deployment could not start, or a process of it died."""


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_public_endpoint(endpoint: str, curve: CurveKeys | None) -> None:
    """ipc:// anywhere; tcp:// on loopback, or on any address only with CurveZMQ keys."""
    if endpoint.startswith("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {endpoint!r} must be ipc://PATH or tcp://HOST:PORT")
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback and curve is None:
        raise ValueError(
            f"refusing to serve on non-loopback {endpoint!r} without CurveZMQ keys: anyone who "
            f"can reach it could use the engine. Generate keys with `sarazmq keys` and pass "
            f"--curve-secret-key, or bind tcp://127.0.0.1:PORT"
        )


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]


class Deployment:
    """A running multi-process deployment (frontend, scheduler, workers, detokenizers).

    Use as a context manager, or start()/wait()/stop(). `endpoint` is where clients
    connect once start() returns.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        endpoint: str | None = None,
        num_detokenizers: int = 1,
        curve: CurveKeys | None = None,
        log_level: str = "WARNING",
        ready_timeout: float = 600.0,
    ) -> None:
        if num_detokenizers < 1:
            raise ValueError(f"num_detokenizers={num_detokenizers} must be >= 1")
        if endpoint is not None:
            check_public_endpoint(endpoint, curve)
        self.config, self.model_config = resolve_engine_config(config)
        self.num_detokenizers = num_detokenizers
        self.curve = curve
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self.rundir = tempfile.mkdtemp(prefix="sarazmq-")  # mode 0700
        ipc = f"ipc://{self.rundir}"
        tp = self.config.tensor_parallel_size
        self.endpoints = Endpoints(
            public=endpoint or f"{ipc}/public.ipc",
            scheduler_in=f"{ipc}/scheduler.ipc",
            frontend_in=f"{ipc}/frontend.ipc",
            worker_plans=[f"{ipc}/worker{r}.ipc" for r in range(tp)],
            worker_result=f"{ipc}/result.ipc",
            detokenizers=[f"{ipc}/detok{i}.ipc" for i in range(num_detokenizers)],
            launcher=f"{ipc}/launcher.ipc",
            dist_init=f"tcp://127.0.0.1:{free_tcp_port()}",
        )
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}
        self.failure: str = ""
        self._ctx = zmq.Context()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()

    @property
    def endpoint(self) -> str:
        return self.endpoints.public

    # ---- start ---------------------------------------------------------------------

    def _spawn(self, kind: str, index: int, threads: int) -> None:
        spec = ProcSpec(
            kind=kind,
            index=index,
            config=self.config,
            model_config=self.model_config,
            endpoints=self.endpoints,
            num_detokenizers=self.num_detokenizers,
            curve=self.curve,
            log_level=self.log_level,
        )
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        popen = subprocess.Popen(
            [sys.executable, "-m", f"sarazmq.procs.{kind}"],
            stdin=subprocess.PIPE,
            env=env,
        )
        assert popen.stdin is not None  # stdin=PIPE
        popen.stdin.write(msgspec.msgpack.encode(spec))
        popen.stdin.close()
        self.children.append(Child(f"{kind}-{index}", popen))

    def start(self) -> str:
        """Starts every process and returns the public endpoint once all are READY."""
        launcher = self._ctx.socket(zmq.PULL)
        launcher.setsockopt(zmq.LINGER, 0)
        launcher.bind(self.endpoints.launcher)
        tp = self.config.tensor_parallel_size
        cores = os.cpu_count() or 1
        worker_threads = self.config.num_threads or max(1, cores // tp)
        try:
            for r in range(tp):
                self._spawn("worker", r, worker_threads)
            self._spawn("scheduler", 0, 1)
            for i in range(self.num_detokenizers):
                self._spawn("detokenizer", i, 1)
            self._spawn("frontend", 0, 1)
            self._await_ready(launcher)
        except BaseException:
            self.stop()
            raise
        finally:
            launcher.close(linger=0)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="sarazmq-watch")
        self._watcher.start()
        return self.endpoint

    def _await_ready(self, launcher: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(LauncherInbound)
        waiting = {c.name for c in self.children}
        deadline = time.monotonic() + self.ready_timeout
        while waiting:
            if time.monotonic() > deadline:
                raise DeploymentError(f"timed out waiting for {sorted(waiting)} to become ready")
            if launcher.poll(200):
                msg = decoder.decode(launcher.recv())
                if isinstance(msg, Failed):
                    raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
                if isinstance(msg, Ready):
                    waiting.discard(msg.name)
                    self.pids[msg.name] = msg.pid
                continue
            for child in self.children:
                code = child.popen.poll()
                if code is not None:
                    # a Failed message may still be queued: it names the cause better
                    if launcher.poll(500):
                        msg = decoder.decode(launcher.recv())
                        if isinstance(msg, Failed):
                            raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
                    raise DeploymentError(f"{child.name} exited with code {code} during start")

    # ---- supervise -----------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.is_set():
            for child in self.children:
                code = child.popen.poll()
                if code is not None and not self._stopping.is_set():
                    how = f"signal {-code}" if code < 0 else f"code {code}"
                    self.failure = f"{child.name} (pid {child.popen.pid}) exited with {how}"
                    log.error("%s; stopping the deployment", self.failure)
                    self._tell_frontend_dead(child.name)
                    self._teardown()
                    self._done.set()
                    return
            self._stopping.wait(0.1)
        self._done.set()

    def _tell_frontend_dead(self, dead_name: str) -> None:
        if dead_name.startswith("frontend"):
            return  # clients notice the missing heartbeats
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.endpoints.frontend_in)
        sock.send(msgspec.msgpack.encode(EngineDead(reason=self.failure)))
        sock.close(linger=1000)
        time.sleep(0.5)  # let the frontend fail the in-flight requests before it is stopped

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until the deployment stops; 0 if stopped on request, 1 if a process died."""
        self._done.wait(timeout)
        return 1 if self.failure else 0

    # ---- stop ----------------------------------------------------------------------

    def _teardown(self) -> None:
        for child in self.children:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for child in self.children:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait()
        shutil.rmtree(self.rundir, ignore_errors=True)
        if self.endpoints.public.startswith("ipc://"):
            path = self.endpoints.public[len("ipc://") :]
            if os.path.exists(path):
                os.unlink(path)

    def stop(self) -> None:
        """Stops every process and removes the ipc files; safe to call twice."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=10)
        self._teardown()
        self._done.set()
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
