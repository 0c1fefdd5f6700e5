"""Launcher / supervisor: starts every process, waits for READY, watches them, tears down.

Where the sockets live is `endpoints`, starting a process and its READY is `spawn`; this
module supervises. If any child dies, the frontend is told to fail every in-flight
request (`EngineDead`), then everything is stopped and the launcher reports failure, or,
with restart="on-failure", starts the deployment again on the same public endpoint.
stop() drains first: the frontend refuses new requests, lets in-flight ones finish for
up to drain_timeout seconds, aborts the rest, and then every child exits 0 on SIGTERM.
Children die with the launcher (PR_SET_PDEATHSIG), so even a kill -9 of the launcher
leaves no process behind.

A multi-node deployment (`DeploymentConfig.nnodes` > 1) runs this on the head (node 0)
with only the head's share of the workers, plus the node link (`sarazmq.procs.nodelink`),
a child like the others: it is READY once every other node's workers are, and a lost
node ends it, which fails the in-flight requests and stops or restarts the deployment
as any dead child does. The other nodes run `sarazmq.procs.node.NodeAgent`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time

import msgspec
import zmq

from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.procs.common import ProcSpec
from sarazmq.procs.endpoints import (
    Endpoints,
    check_http_bind,
    check_ipc_free,
    check_multinode,
    check_public_endpoint,
    dist_init_method,
    link_endpoint,
    make_endpoints,
    make_instance_endpoints,
    node_instances,
    remove_ipc_files,
    world_size,
)
from sarazmq.procs.nodelink import lost_node_reason, tell_nodelink_stopping
from sarazmq.procs.sockets import pull_socket, send_once
from sarazmq.procs.spawn import (
    Child,
    DeploymentError,
    await_drained,
    await_ready,
    decode_launcher_message,
    spawn_child,
    stop_children,
)
from sarazmq.protocol.engine import Drain, EngineDead, InstanceDown, InstanceUp
from sarazmq.protocol.launcher import (
    Drained,
    Failed,
    LauncherInbound,
    NodesJoined,
)
from sarazmq.resolve import resolve_engine_config

log = logging.getLogger("sarazmq.launcher")

__all__ = ["Deployment", "DeploymentError"]


class Deployment:
    """A running multi-process deployment (frontend, scheduler, workers, detokenizers).

    Use as a context manager, or start()/wait()/stop(). `endpoint` is where clients
    connect once start() returns; it stays the same across restarts. `deployment` says
    how it runs (endpoint, detokenizers, restarts, drain, client limits, logs).
    """

    def __init__(self, config: EngineConfig, deployment: DeploymentConfig | None = None) -> None:
        self.deployment = deployment or DeploymentConfig()
        if self.deployment.http_port is not None:
            check_http_bind(self.deployment.http_host, self.deployment.api_key)
        if self.deployment.endpoint is not None:
            check_public_endpoint(self.deployment.endpoint, self.deployment.curve)
            check_ipc_free(self.deployment.endpoint)
        self.config, self.model_config = resolve_engine_config(config)
        if self.deployment.node_rank != 0:
            raise ValueError(
                "a node with --node-rank > 0 runs only its workers: use "
                "sarazmq.procs.node.NodeAgent (`sarazmq serve` does)"
            )
        # the head's workers (all of them on a single node)
        self.local_ranks = check_multinode(self.config, self.deployment)
        self.num_instances = self.config.num_instances
        if self.config.disaggregated and self.multinode:
            raise ValueError(
                "a disaggregated deployment runs on one node: --disaggregate with --nnodes > 1 "
                "is not supported yet"
            )
        # the replicas this node runs: all of them, or with several nodes the head's share
        # (each node runs whole replicas: `procs/replicalink.py`)
        self.local_instances = (
            node_instances(self.num_instances, self.deployment.nnodes, 0)
            if self.multinode and self.num_instances > 1
            else range(self.num_instances)
        )
        # per instance: restarts so far (data-parallel replicas restart one at a time)
        self.instance_restarts = [0] * self.num_instances
        self.down_instances: set[int] = set()
        self.rundir = tempfile.mkdtemp(prefix="sarazmq-")  # mode 0700: only we can enter
        self.endpoints = self._make_endpoints()
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
        self._reports: list[Failed] = []  # why children failed, before they exited
        self._stop_requested = threading.Event()
        self._drain_on_stop = True
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()
        self._cleaned = False

    @property
    def multinode(self) -> bool:
        return self.deployment.nnodes > 1

    @property
    def replicas(self) -> bool:
        """Data-parallel replicas (each a whole instance; several nodes run whole ones)."""
        return self.num_instances > 1

    def _make_endpoints(self) -> Endpoints:
        dep = self.deployment
        return make_endpoints(
            self.rundir,
            dep.endpoint,
            world_size(self.config),
            dep.num_detokenizers,
            # several nodes without replicas share one rendezvous; replicas have their own
            dist_init=dist_init_method(dep) if self.multinode and not self.replicas else None,
            link=link_endpoint(dep) if self.multinode else "",
            num_instances=self.config.num_instances,
        )

    @property
    def endpoint(self) -> str:
        return self.endpoints.public

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (".../v1"), when the deployment serves one."""
        dep = self.deployment
        if dep.http_port is None:
            return None
        return f"http://{dep.http_host}:{dep.http_port}/v1"

    # ---- start ---------------------------------------------------------------------

    def _spawn(self, kind: str, index: int, threads: int, instance: int = 0) -> Child:
        spec = ProcSpec(
            kind=kind,
            index=index,
            config=self.config,
            model_config=self.model_config,
            deployment=self.deployment,
            endpoints=self.endpoints,
            instance=instance,
        )
        child = spawn_child(spec, threads)
        self.children.append(child)
        self.pids[child.name] = child.popen.pid
        return child

    @property
    def worker_threads(self) -> int:
        """Threads per worker: --threads, else the cores shared by every local worker of
        every instance."""
        cores = os.cpu_count() or 1
        workers = len(self.local_ranks) * len(self.local_instances)
        return self.config.num_threads or max(1, cores // workers)

    def _spawn_instance(self, instance: int) -> list[Child]:
        """An instance's workers, scheduler and detokenizers (single node)."""
        kids = [self._spawn("worker", r, self.worker_threads, instance) for r in self.local_ranks]
        kids.append(self._spawn("scheduler", 0, 1, instance))
        for i in range(self.deployment.num_detokenizers):
            kids.append(self._spawn("detokenizer", i, 1, instance))
        return kids

    def _start_children(self) -> None:
        if self._launcher is None:
            raise DeploymentError("the launcher socket is not bound (call start())")
        self.children = []
        self.pids = {}
        self.down_instances = set()

        def spawn_workers(msg: LauncherInbound | None = None) -> None:
            if msg is None or isinstance(msg, NodesJoined):
                for r in self.local_ranks:
                    self._spawn("worker", r, self.worker_threads)

        # several nodes: the head's workers (rank 0 hosts torch.distributed's rendezvous,
        # which waits a bounded time for every rank) start once every node has joined
        spawn_workers_later = None
        if self.multinode and not self.replicas:
            self._spawn("nodelink", 0, 1)
            spawn_workers_later = spawn_workers
            self._spawn("scheduler", 0, 1)
            for i in range(self.deployment.num_detokenizers):
                self._spawn("detokenizer", i, 1)
        else:
            if self.multinode:  # the other nodes' replicas, through the node link
                self._spawn("replicalink", 0, 1)
            for instance in self.local_instances:
                self._spawn_instance(instance)
        self._spawn("frontend", 0, 1)
        if self.deployment.http_port is not None:
            self._spawn("api", 0, 1)
        await_ready(
            self._launcher,
            self.children,
            self.deployment.ready_timeout,
            self._stop_requested,
            spawn_workers_later,
        )

    def start(self) -> str:
        """Starts every process and returns the public endpoint once all are READY."""
        self._launcher = pull_socket(self._ctx, self.endpoints.launcher, private=True)
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

    # ---- supervise -----------------------------------------------------------------

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if child.popen.poll() is not None:
                return child
        return None

    def _watch(self) -> None:
        launcher = self._launcher
        try:
            while launcher is not None:
                if self._stop_requested.is_set():
                    if self.multinode:  # the nodes learn that it is no failure
                        tell_nodelink_stopping(self._ctx, self.endpoints.link_control)
                    if self._drain_on_stop:
                        self._drain(launcher)
                    self._kill_children()
                    return
                dead = self._dead_child()
                if dead is not None:
                    if not self._on_child_death(dead):
                        return
                    continue
                if launcher.poll(100):
                    # late READYs etc.: nothing to do; a Failed explains a death to come
                    msg = decode_launcher_message(self._decoder, launcher.recv())
                    if isinstance(msg, Failed):
                        self._reports.append(msg)
        except Exception:  # noqa: BLE001 - the watcher must always leave a clean state
            log.exception("supervisor failed")
            self.failure = self.failure or "supervisor failed"
            self._kill_children()
        finally:
            self._cleanup()
            self._done.set()

    def _on_child_death(self, dead: Child) -> bool:
        """Fails in-flight requests, stops the rest; True if the deployment restarted.
        With several instances, a process of one instance takes only that instance down
        (`_on_instance_death`)."""
        if self.num_instances > 1 and dead.instance is not None:
            return self._on_instance_death(dead)
        code = dead.popen.returncode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        self.failure = self._lost_node() or f"{dead.name} (pid {dead.popen.pid}) exited with {how}"
        self.failures.append(self.failure)
        log.error("%s; stopping the deployment", self.failure)
        self._tell_frontend_dead(dead.name)
        self._kill_children()
        if self.deployment.restart != "on-failure" or self._stop_requested.is_set():
            return False
        if self.restarts >= self.deployment.max_restarts:
            self.failure += f" (gave up after {self.restarts} restart(s))"
            log.error("%s", self.failure)
            return False
        self.restarts += 1
        log.warning(
            "restarting the deployment (restart %d of %d)",
            self.restarts,
            self.deployment.max_restarts,
        )
        self._remove_ipc_files()
        self._drain_launcher_socket()
        # same paths (the launcher socket stays bound), a fresh torch.distributed port
        self.endpoints = self._make_endpoints()
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

    def _on_instance_death(self, dead: Child) -> bool:
        """One replica's process died: the frontend re-routes that replica's requests that
        have streamed nothing and fails the others (`InstanceDown`), its other processes
        stop, and with restart="on-failure" it starts again alone and rejoins the rotation
        (`InstanceUp`). False (the deployment stops) once no replica is up or coming back."""
        instance = dead.instance
        assert instance is not None  # the caller checked
        code = dead.popen.returncode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        reason = f"{dead.name} (pid {dead.popen.pid}) exited with {how}"
        self.failures.append(reason)
        name = self._instance_name(instance)
        log.error("%s; stopping %s", reason, name)
        # the frontend must hear it: its requests on the replica wait for nothing else
        for _ in range(3):
            if self._send_to_frontend(InstanceDown(instance=instance, reason=reason)):
                break
            time.sleep(0.5)
        mine = [c for c in self.children if c.instance == instance]
        stop_children(mine)
        self.children = [c for c in self.children if c.instance != instance]
        self.down_instances.add(instance)
        restart = (
            self.deployment.restart == "on-failure"
            and not self._stop_requested.is_set()
            and self.instance_restarts[instance] < self.deployment.max_restarts
        )
        if restart:
            self.instance_restarts[instance] += 1
            log.warning(
                "restarting %s (restart %d of %d)",
                name,
                self.instance_restarts[instance],
                self.deployment.max_restarts,
            )
            self._remove_ipc_files(prefix=f"r{instance}-" if instance else "")
            # the same ipc paths (the frontend's sockets reconnect), a fresh rendezvous port
            old = self.endpoints.instances[instance]
            self.endpoints.instances[instance] = make_instance_endpoints(
                self.rundir, instance, len(old.worker_plans), len(old.detokenizers)
            )
            try:
                kids = self._spawn_instance(instance)
                if self._launcher is None:
                    raise DeploymentError("the launcher socket is closed")
                await_ready(
                    self._launcher, kids, self.deployment.ready_timeout, self._stop_requested
                )
            except DeploymentError as e:
                log.error("%s did not restart: %s", name, e)
                self.failures.append(f"{name} restart failed: {e}")
                stop_children([c for c in self.children if c.instance == instance])
                self.children = [c for c in self.children if c.instance != instance]
            else:
                self.down_instances.discard(instance)
                self._send_to_frontend(InstanceUp(instance=instance))
                log.warning("%s restarted and back in the rotation", name)
        # replicas on other nodes may still serve: the frontend fails what finds none up
        if self.multinode or len(self.down_instances) < self.num_instances:
            return True
        self.failure = f"every replica is down (last: {reason})"
        log.error("%s; stopping the deployment", self.failure)
        self._tell_frontend_dead("scheduler")
        self._kill_children()
        return False

    def _instance_name(self, instance: int) -> str:
        """ "replica 2", or in a disaggregated deployment "prefill instance 0"."""
        role = self.config.instance_role(instance)
        return f"replica {instance}" if role == "mixed" else f"{role} instance {instance}"

    def _lost_node(self) -> str:
        """Multi-node: why a node was lost, if the node link says so within about a
        heartbeat ("" if not). A lost node is the cause of whatever died with it (a head
        worker's collective with the node's ranks breaks at once)."""
        reports, self._reports = self._reports, []
        if not self.multinode or self._launcher is None:
            return ""
        return lost_node_reason(self._launcher, self._decoder, reports)

    def _drain_launcher_socket(self) -> None:
        """Drops what the stopped processes sent, so a restart's READY wait sees only
        the new ones."""
        while self._launcher is not None and self._launcher.poll(0):
            self._launcher.recv()
        self._reports = []

    def _tell_frontend_dead(self, dead_name: str) -> None:
        if dead_name.startswith("frontend"):
            return  # its clients see the connection drop (or the heartbeats stop)
        if self._send_to_frontend(EngineDead(reason=self.failure)):
            time.sleep(0.5)  # let the frontend fail the in-flight requests before it stops

    def _send_to_frontend(self, msg: Drain | EngineDead | InstanceDown | InstanceUp) -> bool:
        """One message to the frontend's inbound socket; False if it could not be sent."""
        return send_once(self._ctx, self.endpoints.frontend_in, msg)

    def _drain(self, launcher: zmq.Socket) -> None:
        """Asks the frontend to drain and waits (bounded) for it to say it is done."""
        frontend = next((c for c in self.children if c.name.startswith("frontend")), None)
        if frontend is None or frontend.popen.poll() is not None:
            return
        timeout = self.deployment.drain_timeout
        if self._send_to_frontend(Drain(timeout=timeout)):
            self.drained = await_drained(launcher, self._decoder, timeout, self._dead_child)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until the deployment stops; 0 if stopped on request, 1 if a process died."""
        self._done.wait(timeout)
        return 1 if self.failure else 0

    # ---- stop ----------------------------------------------------------------------

    def _kill_children(self) -> None:
        self.exit_codes = stop_children(self.children)

    def _remove_ipc_files(self, prefix: str | None = None) -> None:
        remove_ipc_files(self.rundir, self.endpoints.public, prefix)

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
            self._watcher.join(timeout=self.deployment.drain_timeout + 30)
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
