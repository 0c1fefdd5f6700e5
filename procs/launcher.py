"""Launcher / supervisor: starts every process, waits for READY, watches them, tears down.

Children are plain subprocesses (`python -m sarazmq.procs.<kind>`) that read their spec
as msgpack from stdin: no pickle, no fork of a process holding torch threads. Internal
sockets are ipc files in a private 0700 directory that the launcher removes at exit.
If any child dies, the frontend is told to fail every in-flight request
(`EngineDead`), then everything is stopped and the launcher reports failure, or, with
restart="on-failure", starts the deployment again on the same public endpoint.
stop() drains first: the frontend refuses new requests, lets in-flight ones finish for
up to drain_timeout seconds, aborts the rest, and then every child exits 0 on SIGTERM.
Children die with the launcher (PR_SET_PDEATHSIG), so even a kill -9 of the launcher
leaves no process behind.
"""

from __future__ import annotations

import contextlib
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
from sarazmq.protocol import Drain, Drained, EngineDead, Failed, LauncherInbound, Ready
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


def check_ipc_free(endpoint: str) -> None:
    """Refuses an ipc endpoint that a live process is serving on (libzmq would silently
    take the path over); removes a stale socket file left by a dead one."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: nobody listens
        return
    except OSError as e:
        raise ValueError(f"endpoint {endpoint!r} exists and cannot be probed: {e}") from None
    finally:
        probe.close()
    raise ValueError(f"endpoint {endpoint!r} is in use by another running process")


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]


RESTART_POLICIES = ("no", "on-failure")


class Deployment:
    """A running multi-process deployment (frontend, scheduler, workers, detokenizers).

    Use as a context manager, or start()/wait()/stop(). `endpoint` is where clients
    connect once start() returns; it stays the same across restarts.

    restart: "no" (a dead child stops the deployment: wait() returns 1) or
        "on-failure" (the deployment is torn down and started again on the same public
        endpoint, at most max_restarts times).
    drain_timeout: on stop(), seconds in-flight requests get to finish before they are
        aborted (0: stop at once).
    client_timeout / max_client_backlog: see `ProcSpec`.
    log_file: where the children's stdout/stderr go (appended); default: inherited.
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
        restart: str = "no",
        max_restarts: int = 3,
        drain_timeout: float = 30.0,
        client_timeout: float = 15.0,
        max_client_backlog: int = 10_000,
        log_file: str | None = None,
    ) -> None:
        if num_detokenizers < 1:
            raise ValueError(f"num_detokenizers={num_detokenizers} must be >= 1")
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart={restart!r} must be one of {RESTART_POLICIES}")
        if max_restarts < 0 or drain_timeout < 0 or client_timeout <= 0:
            raise ValueError("max_restarts and drain_timeout must be >= 0, client_timeout > 0")
        if max_client_backlog < 1:
            raise ValueError(f"max_client_backlog={max_client_backlog} must be >= 1")
        if endpoint is not None:
            check_public_endpoint(endpoint, curve)
            check_ipc_free(endpoint)
        self.config, self.model_config = resolve_engine_config(config)
        self.num_detokenizers = num_detokenizers
        self.curve = curve
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self.restart = restart
        self.max_restarts = max_restarts
        self.drain_timeout = drain_timeout
        self.client_timeout = client_timeout
        self.max_client_backlog = max_client_backlog
        self.log_file = log_file
        self.rundir = tempfile.mkdtemp(prefix="sarazmq-")  # mode 0700: only we can enter
        self.endpoints = self._make_endpoints(endpoint)
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}
        self.failure: str = ""
        self.failures: list[str] = []  # every child death, restarted or not
        self.restarts = 0
        self.exit_codes: dict[str, int] = {}  # of the last processes stopped
        self.drained: Drained | None = None
        self._ctx = zmq.Context()
        self._launcher: zmq.Socket | None = None
        self._decoder = msgspec.msgpack.Decoder(LauncherInbound)
        self._stop_requested = threading.Event()
        self._drain_on_stop = True
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()
        self._cleaned = False

    def _make_endpoints(self, public: str | None) -> Endpoints:
        ipc = f"ipc://{self.rundir}"
        tp = self.config.tensor_parallel_size
        return Endpoints(
            public=public or f"{ipc}/public.ipc",
            scheduler_in=f"{ipc}/scheduler.ipc",
            frontend_in=f"{ipc}/frontend.ipc",
            worker_plans=[f"{ipc}/worker{r}.ipc" for r in range(tp)],
            worker_result=f"{ipc}/result.ipc",
            detokenizers=[f"{ipc}/detok{i}.ipc" for i in range(self.num_detokenizers)],
            launcher=f"{ipc}/launcher.ipc",
            dist_init=f"tcp://127.0.0.1:{free_tcp_port()}",
        )

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
            client_timeout=self.client_timeout,
            max_client_backlog=self.max_client_backlog,
        )
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        out = open(self.log_file, "ab") if self.log_file else None
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", f"sarazmq.procs.{kind}"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                env=env,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor
        assert popen.stdin is not None  # stdin=PIPE
        popen.stdin.write(msgspec.msgpack.encode(spec))
        popen.stdin.close()
        name = f"{kind}-{index}"
        self.children.append(Child(name, popen))
        self.pids[name] = popen.pid

    def _start_children(self) -> None:
        assert self._launcher is not None  # bound by start()
        tp = self.config.tensor_parallel_size
        cores = os.cpu_count() or 1
        worker_threads = self.config.num_threads or max(1, cores // tp)
        self.children = []
        self.pids = {}
        for r in range(tp):
            self._spawn("worker", r, worker_threads)
        self._spawn("scheduler", 0, 1)
        for i in range(self.num_detokenizers):
            self._spawn("detokenizer", i, 1)
        self._spawn("frontend", 0, 1)
        self._await_ready(self._launcher)

    def start(self) -> str:
        """Starts every process and returns the public endpoint once all are READY."""
        launcher = self._ctx.socket(zmq.PULL)
        launcher.setsockopt(zmq.LINGER, 0)
        launcher.bind(self.endpoints.launcher)
        os.chmod(self.endpoints.launcher[len("ipc://") :], 0o600)  # like the children's
        self._launcher = launcher
        try:
            self._start_children()
        except BaseException:
            self._drain_on_stop = False
            self._kill_children()
            self._cleanup()
            self._done.set()
            self._ctx.destroy(linger=0)
            raise
        # from here on only the watcher thread uses the launcher socket
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="sarazmq-watch")
        self._watcher.start()
        return self.endpoint

    def _await_ready(self, launcher: zmq.Socket) -> None:
        waiting = {c.name for c in self.children}
        deadline = time.monotonic() + self.ready_timeout
        while waiting:
            if time.monotonic() > deadline:
                raise DeploymentError(f"timed out waiting for {sorted(waiting)} to become ready")
            if self._stop_requested.is_set():  # e.g. Ctrl-C during a long model load
                raise DeploymentError("stopped while starting")
            if launcher.poll(200):
                msg = self._decode(launcher.recv())
                if isinstance(msg, Failed):
                    raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
                if isinstance(msg, Ready):
                    waiting.discard(msg.name)
                continue
            for child in self.children:
                code = child.popen.poll()
                if code is not None:
                    # a Failed message may still be queued: it names the cause better
                    if launcher.poll(500):
                        msg = self._decode(launcher.recv())
                        if isinstance(msg, Failed):
                            raise DeploymentError(f"{msg.name} failed to start: {msg.error}")
                    raise DeploymentError(f"{child.name} exited with code {code} during start")

    def _decode(self, frame: bytes) -> LauncherInbound | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("undecodable message to the launcher: %s", e)
            return None

    # ---- supervise -----------------------------------------------------------------

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if child.popen.poll() is not None:
                return child
        return None

    def _watch(self) -> None:
        assert self._launcher is not None  # bound by start()
        try:
            while True:
                if self._stop_requested.is_set():
                    if self._drain_on_stop:
                        self._drain()
                    self._kill_children()
                    return
                dead = self._dead_child()
                if dead is not None:
                    if not self._on_child_death(dead):
                        return
                    continue
                if self._launcher.poll(100):
                    self._decode(self._launcher.recv())  # late READYs etc.: nothing to do
        except Exception:  # noqa: BLE001 - the watcher must always leave a clean state
            log.exception("supervisor failed")
            self.failure = self.failure or "supervisor failed"
            self._kill_children()
        finally:
            self._cleanup()
            self._done.set()

    def _on_child_death(self, dead: Child) -> bool:
        """Fails in-flight requests, stops the rest; True if the deployment restarted."""
        code = dead.popen.returncode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        self.failure = f"{dead.name} (pid {dead.popen.pid}) exited with {how}"
        self.failures.append(self.failure)
        log.error("%s; stopping the deployment", self.failure)
        self._tell_frontend_dead(dead.name)
        self._kill_children()
        if self.restart != "on-failure" or self._stop_requested.is_set():
            return False
        if self.restarts >= self.max_restarts:
            self.failure += f" (gave up after {self.restarts} restart(s))"
            log.error("%s", self.failure)
            return False
        self.restarts += 1
        log.warning(
            "restarting the deployment (restart %d of %d)", self.restarts, self.max_restarts
        )
        self._remove_ipc_files()
        # same paths (the launcher socket stays bound), a fresh torch.distributed port
        self.endpoints = self._make_endpoints(self.endpoints.public)
        try:
            self._start_children()
        except DeploymentError as e:
            self.failure = f"{self.failure}; restart failed: {e}"
            log.error("%s", self.failure)
            self._kill_children()
            return False
        self.failure = ""
        log.warning("restarted; serving on %s", self.endpoint)
        return True

    def _tell_frontend_dead(self, dead_name: str) -> None:
        if dead_name.startswith("frontend"):
            return  # its clients see the connection drop (or the heartbeats stop)
        if self._send_to_frontend(EngineDead(reason=self.failure)):
            time.sleep(0.5)  # let the frontend fail the in-flight requests before it stops

    def _send_to_frontend(self, msg: Drain | EngineDead) -> bool:
        """One message to the frontend's inbound socket; False if it could not be sent."""
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        try:
            sock.connect(self.endpoints.frontend_in)
            sock.send(msgspec.msgpack.encode(msg))
            return True
        except zmq.ZMQError as e:
            log.error("could not send %s to the frontend: %s", type(msg).__name__, e)
            return False
        finally:
            # linger: the connect is asynchronous, the message may still be queued here
            sock.close(linger=1000)

    def _drain(self) -> None:
        """Asks the frontend to drain and waits (bounded) for it to say it is done."""
        assert self._launcher is not None  # bound by start()
        frontend = next((c for c in self.children if c.name.startswith("frontend")), None)
        if frontend is None or frontend.popen.poll() is not None:
            return
        if not self._send_to_frontend(Drain(timeout=self.drain_timeout)):
            return
        # past its deadline the frontend aborts what is left; give the aborts time to return
        deadline = time.monotonic() + self.drain_timeout + 5.0
        while time.monotonic() < deadline and self._dead_child() is None:
            if self._launcher.poll(100):
                msg = self._decode(self._launcher.recv())
                if isinstance(msg, Drained):
                    self.drained = msg
                    time.sleep(0.2)  # the last replies are on their way out of the frontend
                    return
        log.error("the deployment did not drain in time; stopping it anyway")

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until the deployment stops; 0 if stopped on request, 1 if a process died."""
        self._done.wait(timeout)
        return 1 if self.failure else 0

    # ---- stop ----------------------------------------------------------------------

    def _kill_children(self) -> None:
        for child in self.children:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for child in self.children:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop on SIGTERM; killing it", child.name)
                child.popen.kill()
                child.popen.wait()
        self.exit_codes = {c.name: c.popen.returncode for c in self.children}

    def _remove_ipc_files(self) -> None:
        for name in os.listdir(self.rundir):
            if name.endswith(".ipc") and name != "launcher.ipc":
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.rundir, name))
        if self.endpoints.public.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.endpoints.public[len("ipc://") :])

    def _cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        if self._launcher is not None:
            self._launcher.close(linger=0)
        self._remove_ipc_files()
        shutil.rmtree(self.rundir, ignore_errors=True)

    def request_stop(self, drain: bool = True) -> None:
        """Asks the deployment to stop (drain first if `drain`); returns at once.

        Safe from a signal handler; wait() tells when it is done."""
        self._drain_on_stop = self._drain_on_stop and drain
        self._stop_requested.set()

    def stop(self, drain: bool = True) -> None:
        """Stops every process (after draining in-flight requests if `drain`) and removes
        the ipc files; safe to call twice."""
        self.request_stop(drain)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.drain_timeout + 30)
        if self._watcher is None or not self._watcher.is_alive():
            # never started, or the watcher is gone: clean up here
            self._kill_children()
            self._cleanup()
            self._done.set()
        if not self._ctx.closed and (self._watcher is None or not self._watcher.is_alive()):
            self._ctx.destroy(linger=0)

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
