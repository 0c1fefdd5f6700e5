"""A node of a multi-node deployment other than the head: joins it, runs its workers.

`sarazmq serve --nnodes K --node-rank r ...` (r > 0) runs a `NodeAgent` in the launcher
process itself: it connects to the head's node link (tcp, master_port + 1), sends `Join`
until answered, and on `Welcome` starts this node's workers (a contiguous block of the
tp x pp ranks) with the head's engine config, its own model path, and
torch.distributed's rendezvous at master_addr:master_port. It then relays: plans from
the head to its workers' ipc sockets, results from them to the head, a `Beat` each way
every second. It supervises like the head's launcher: a worker that dies, or a head that
goes silent for NODE_TIMEOUT_S or stops after a failure, ends the session (its workers
stopped; the head told, if it can be); with restart="on-failure" the node then joins
again (the head waits for it when it restarts), otherwise it exits non-zero. A head
that stops on request stops the node with exit 0.

A join is refused, and the node exits at once (`NodeRefused`), when the head's answer
says so (world size, node count, node rank or model differ) or when the link's
CurveZMQ handshake fails: ZeroMQ retries a failed handshake silently, so a connection
that does not complete its handshake within HANDSHAKE_TIMEOUT_S is a wrong key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.procs.common import ProcSpec
from sarazmq.procs.endpoints import check_multinode, link_endpoint, make_endpoints, world_size
from sarazmq.procs.nodelink import BEAT_INTERVAL_S, NODE_TIMEOUT_S, STOP_WAIT_S
from sarazmq.procs.sockets import link_dealer, pull_socket, push_socket
from sarazmq.procs.spawn import Child, decode_launcher_message, spawn_child, stop_children
from sarazmq.protocol.launcher import (
    LINK_VERSION,
    Beat,
    Bye,
    Failed,
    FromInstance,
    FromWorker,
    HeadToNode,
    Join,
    LauncherInbound,
    NodeFailed,
    NodeReady,
    NodeToHead,
    Ready,
    Refused,
    Stop,
    ToInstance,
    ToWorker,
    Welcome,
)
from sarazmq.resolve import resolve_engine_config

#: Seconds a tcp connection to the head may take to complete its CurveZMQ handshake.
HANDSHAKE_TIMEOUT_S = 5.0
#: Seconds between Joins while the head has not answered.
JOIN_RETRY_S = 2.0
log = logging.getLogger("sarazmq.node")
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class NodeError(RuntimeError):
    """The node's session ended in a failure (a worker died, the head was lost or failed)."""


class NodeRefused(NodeError):
    """The head refused this node, or the link's handshake failed: retrying cannot help."""


class NodeAgent:
    """One non-head node: join, start the workers, relay, supervise (see the module doc).

    run() blocks until the node stops and returns the exit code (0: the head or this
    node's operator stopped it; 1: a failure it did not, or could no longer, restart
    from); it raises NodeRefused when the head refuses the node. request_stop() is safe
    from a signal handler; on_ready(agent) is called each time the workers serve.
    """

    def __init__(self, config: EngineConfig, deployment: DeploymentConfig) -> None:
        if deployment.nnodes < 2 or deployment.node_rank < 1:
            raise ValueError(
                f"a NodeAgent is a node with --node-rank >= 1 of --nnodes >= 2 (got node "
                f"{deployment.node_rank} of {deployment.nnodes}); node 0 is the head"
            )
        self.deployment = deployment
        self.config, self.model_config = resolve_engine_config(config)
        self.ranks = check_multinode(self.config, deployment)
        self.link = link_endpoint(deployment)
        self.host = socket.gethostname()
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}
        self.failures: list[str] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(HeadToNode)

    @property
    def failure(self) -> str:
        """The last failure ("" if none)."""
        return self.failures[-1] if self.failures else ""

    def request_stop(self) -> None:
        """Asks the node to stop (its workers, then run() returns 0)."""
        self._stop.set()

    def run(self, on_ready: Callable[[NodeAgent], None] | None = None) -> int:
        dep = self.deployment
        while True:
            try:
                self._session(on_ready)
                return 0
            except NodeRefused:
                raise
            except NodeError as e:
                if self._stop.is_set():
                    return 0  # stopped by this node's operator
                self.failures.append(str(e))
                log.error("node %d: %s", dep.node_rank, e)
            if dep.restart != "on-failure" or self.restarts >= dep.max_restarts:
                return 1
            self.restarts += 1
            log.warning(
                "node %d: joining the head again (restart %d of %d)",
                dep.node_rank,
                self.restarts,
                dep.max_restarts,
            )

    # ---- one session: join, serve, stop ----------------------------------------------

    def _session(self, on_ready: Callable[[NodeAgent], None] | None) -> None:
        rundir = tempfile.mkdtemp(prefix="sarazmq-node-")  # mode 0700
        ctx = zmq.Context()
        self.children, self.pids = [], {}
        try:
            dealer = link_dealer(ctx, self.link, self.deployment.curve)
            welcome = self._join(dealer)
            self._serve(ctx, dealer, rundir, welcome, on_ready)
        finally:
            stop_children(self.children)
            ctx.destroy(linger=0)
            shutil.rmtree(rundir, ignore_errors=True)

    def _join(self, dealer: zmq.Socket) -> Welcome:
        """Sends Join until the head answers; returns its Welcome."""
        dep = self.deployment
        session = secrets.token_hex(8)
        join = self._enc.encode(
            Join(
                version=LINK_VERSION,
                node_rank=dep.node_rank,
                nnodes=dep.nnodes,
                num_workers=world_size(self.config),
                session=session,
                host=self.host,
                model=self.model_config,
                num_instances=self.config.data_parallel_size,
            )
        )
        monitor = dealer.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
        )
        try:
            deadline = time.monotonic() + dep.ready_timeout
            next_join = 0.0
            connected_at: float | None = None
            handshaken = False
            while True:
                now = time.monotonic()
                if self._stop.is_set():
                    raise NodeError("stopped while joining")
                if now > deadline:
                    raise NodeError(f"no head answered at {self.link} in {dep.ready_timeout} s")
                while monitor.poll(0):
                    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                    if event & _HANDSHAKE_FAILED:
                        raise NodeRefused(self._handshake_refusal())
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        handshaken = True
                    elif event == zmq.EVENT_CONNECTED and connected_at is None:
                        connected_at = now
                if (
                    not handshaken
                    and connected_at is not None
                    and now - connected_at > HANDSHAKE_TIMEOUT_S
                ):
                    raise NodeRefused(self._handshake_refusal())
                if handshaken and now >= next_join:
                    try:
                        dealer.send(join, zmq.NOBLOCK)
                        next_join = now + JOIN_RETRY_S
                    except zmq.Again:
                        pass  # the connection is not up yet
                if not dealer.poll(100):
                    continue
                msg = self._decode(dealer.recv())
                if isinstance(msg, Welcome) and msg.session == session:
                    return msg
                if isinstance(msg, Refused) and msg.session == session:
                    if not msg.retry:
                        raise NodeRefused(
                            f"the head at {self.link} refused node {dep.node_rank}: {msg.reason}"
                        )
                    log.warning("the head asks to retry: %s", msg.reason)
        finally:
            dealer.disable_monitor()
            monitor.close(linger=0)

    def _handshake_refusal(self) -> str:
        keys = "with" if self.deployment.curve is not None else "without"
        return (
            f"the CurveZMQ handshake with the head at {self.link} failed (this node runs "
            f"{keys} keys): every node needs the head's --curve-key-file (or none, on loopback)"
        )

    def _decode(self, frame: bytes) -> HeadToNode | None:
        try:
            return self._dec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("undecodable message from the head: %s", e)
            return None

    def _node_config(self, welcome: Welcome) -> EngineConfig:
        """The head's engine config, with this node's model path and threads."""
        head = welcome.config
        if world_size(head) != world_size(self.config):  # the head checked; be sure
            raise NodeRefused("the head's world size differs from this node's")
        return dataclasses.replace(
            head, model=self.config.model, num_threads=self.config.num_threads
        )

    def _spawn(self, spec: ProcSpec, threads: int) -> None:
        child = spawn_child(spec, threads)
        self.children.append(child)
        self.pids[child.name] = child.popen.pid

    def _relay(self, ctx: zmq.Context, rundir: str, welcome: Welcome) -> _Relay:
        """Starts what the head asks this node to run and the sockets between it and the
        link: its worker ranks (plans in, results out), or whole replicas (their
        schedulers' inbound frames in, what they send the frontend out)."""
        config = self._node_config(welcome)
        cores = os.cpu_count() or 1
        if welcome.instances:
            endpoints = make_endpoints(
                rundir, None, world_size(config), self.deployment.num_detokenizers,
                num_instances=config.data_parallel_size,
            )  # fmt: skip
            base = ProcSpec("worker", 0, config, self.model_config, self.deployment, endpoints)
            relay = _Relay(
                pull_socket(ctx, endpoints.launcher, private=True),
                pull_socket(ctx, endpoints.frontend_in),
                {
                    i: push_socket(ctx, endpoints.instances[i].scheduler_in)
                    for i in welcome.instances
                },
                FromInstance,
            )
            workers = world_size(config) * len(welcome.instances)
            threads = config.num_threads or max(1, cores // workers)
            for i in welcome.instances:
                for r in range(world_size(config)):
                    self._spawn(msgspec.structs.replace(base, index=r, instance=i), threads)
                self._spawn(msgspec.structs.replace(base, kind="scheduler", instance=i), 1)
                for d in range(self.deployment.num_detokenizers):
                    self._spawn(
                        msgspec.structs.replace(base, kind="detokenizer", index=d, instance=i), 1
                    )
            return relay
        endpoints = make_endpoints(
            rundir, None, world_size(config), 1, dist_init=welcome.dist_init, link=self.link
        )
        spec = ProcSpec("worker", 0, config, self.model_config, self.deployment, endpoints)
        relay = _Relay(
            pull_socket(ctx, endpoints.launcher, private=True),
            pull_socket(ctx, spec.own.worker_result),
            {},
            FromWorker,
        )
        threads = config.num_threads or max(1, cores // len(welcome.ranks))
        for r in welcome.ranks:
            self._spawn(msgspec.structs.replace(spec, index=r), threads)
        relay.targets = {r: push_socket(ctx, spec.own.worker_plans[r]) for r in welcome.ranks}
        return relay

    def _serve(
        self,
        ctx: zmq.Context,
        dealer: zmq.Socket,
        rundir: str,
        welcome: Welcome,
        on_ready: Callable[[NodeAgent], None] | None,
    ) -> None:
        """Starts the node's processes and relays until the session ends: returns on a
        requested stop, raises NodeError on a failure."""
        relay = self._relay(ctx, rundir, welcome)
        launcher, results = relay.launcher, relay.outbound
        poller = zmq.Poller()
        for sock in (dealer, results, launcher):
            poller.register(sock, zmq.POLLIN)
        ldec = msgspec.msgpack.Decoder(LauncherInbound)
        waiting = {c.name for c in self.children}
        seq_in = seq_out = 0
        last_head = next_beat = time.monotonic()

        def fail(reason: str) -> NodeError:
            """Reports the failure; the head answers with Stop (read, so that closing
            does not reset the connection under the report)."""
            self._send(dealer, NodeFailed(reason=reason))
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:
                if dealer.poll(50) and isinstance(self._decode(dealer.recv()), Stop):
                    self._send(dealer, Bye())
                    break
            dealer.close(linger=1000)
            return NodeError(reason)

        while True:
            if self._stop.is_set():
                fail(f"node {self.deployment.node_rank} was stopped by its operator")
                return
            events = dict(poller.poll(100))
            now = time.monotonic()
            while dealer in events and dealer.poll(0):
                msg = self._decode(dealer.recv())
                last_head = now
                if isinstance(msg, (ToWorker, ToInstance)):
                    key = msg.rank if isinstance(msg, ToWorker) else msg.instance
                    target = relay.targets.get(key)
                    if msg.seq != seq_in or target is None:
                        raise fail(f"frame {msg.seq} for {key} is out of order or misaddressed")
                    seq_in += 1
                    target.send(msg.frame)
                elif isinstance(msg, Stop):
                    self._send(dealer, Bye())
                    dealer.close(linger=1000)
                    if msg.failed:
                        raise NodeError(msg.reason)
                    log.info("the head stopped the deployment: %s", msg.reason)
                    return
            while results in events and results.poll(0):
                self._send(dealer, relay.wrap(seq_out, results.recv()))
                seq_out += 1
            while launcher in events and launcher.poll(0):
                lmsg = decode_launcher_message(ldec, launcher.recv())
                if isinstance(lmsg, Failed):
                    raise fail(f"{lmsg.name} failed to start: {lmsg.error}")
                if isinstance(lmsg, Ready) and lmsg.name in waiting:
                    waiting.discard(lmsg.name)
                    if not waiting:
                        self._send(dealer, NodeReady(pids=dict(self.pids)))
                        if on_ready is not None:
                            on_ready(self)
            for child in self.children:
                code = child.popen.poll()
                if code is not None:
                    how = f"signal {-code}" if code < 0 else f"code {code}"
                    raise fail(f"{child.name} (pid {child.popen.pid}) exited with {how}")
            if now - last_head > NODE_TIMEOUT_S:
                raise NodeError(f"lost the head: no heartbeat for {now - last_head:.1f} s")
            if now >= next_beat:
                next_beat = now + BEAT_INTERVAL_S
                self._send(dealer, Beat(time=now))

    def _send(self, dealer: zmq.Socket, msg: NodeToHead) -> None:
        try:
            dealer.send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the head is gone: its silence ends the session
            log.warning("could not send %s to the head: %s", type(msg).__name__, e)


@dataclass
class _Relay:
    """Between the link and what a node runs: the node's launcher socket (READY), the
    socket of frames for the head (`outbound`, sent as `wrap(seq, frame)`), and where the
    head's frames go (`targets`: by worker rank, or by replica)."""

    launcher: zmq.Socket
    outbound: zmq.Socket
    targets: dict[int, zmq.Socket]
    wrap: Callable[[int, bytes], NodeToHead]
