"""The head's end of the node link (multi-node deployments), a child of the head's launcher.

It binds the node link (tcp ROUTER; with the deployment's CurveZMQ keys it admits only
clients that hold the same keypair), answers each node's `Join` (`Welcome` once the
version, node count, world size, node rank and model match the head's; `Refused` with
the reason otherwise) and says READY once every node's workers are ready. Serving, it
binds the plan sockets of the remote ranks on the head and relays the scheduler's frames
to their node, and the remote workers' results to the scheduler; both ends send a `Beat`
every second. A node that reports a failure, goes silent for NODE_TIMEOUT_S,
disconnects or loses a frame ends this process (exit 1) after a `Failed` naming the
node: to the launcher that is a dead child like any other, so every in-flight request
fails at once and the deployment stops, or restarts and waits for the node to join again.
On SIGTERM it tells every node to stop (`Stop`; failed unless the launcher said first
that the stop was requested).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from sarazmq.config import ModelConfig
from sarazmq.procs.common import ProcSpec, Stopped, run_process
from sarazmq.procs.endpoints import node_ranks, world_size
from sarazmq.procs.sockets import NodeKeyCheck, link_router, pull_socket, push_socket
from sarazmq.protocol.engine import NodesStatus
from sarazmq.protocol.launcher import (
    LINK_VERSION,
    Beat,
    Bye,
    Failed,
    FromWorker,
    HeadStopping,
    HeadToNode,
    Join,
    NodeFailed,
    NodeReady,
    NodesJoined,
    NodeToHead,
    Refused,
    Stop,
    ToWorker,
    Welcome,
)

#: Seconds between heartbeats, and of silence after which a node (or the head) is gone.
BEAT_INTERVAL_S = 1.0
NODE_TIMEOUT_S = 5.0
#: Seconds the head waits for the nodes' Bye after telling them to stop.
STOP_WAIT_S = 2.0
log = logging.getLogger("sarazmq.nodelink")


def _is_bye(decoder: msgspec.msgpack.Decoder, frame: bytes) -> bool:
    try:
        return isinstance(decoder.decode(frame), Bye)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


class NodeLost(Exception):
    """A node can no longer serve; the message names it and says why."""

    def __init__(self, node: NodeState, why: str) -> None:
        super().__init__(f"{node.name} {why}")
        self.node_rank = node.rank


@dataclass
class NodeState:
    """What the head knows of one node (rank > 0)."""

    rank: int
    ranks: range
    identity: bytes | None = None
    # with data-parallel replicas: the replicas the node runs whole (ranks is then empty)
    instances: list[int] = field(default_factory=list)
    session: str = ""
    host: str = ""
    last_seen: float = 0.0
    ready: bool = False
    pids: dict[str, int] = field(default_factory=dict)
    seq_out: int = 0
    seq_in: int = 0

    @property
    def name(self) -> str:
        return f"node {self.rank}" + (f" ({self.host})" if self.host else "")


def model_mismatch(head: ModelConfig, node: ModelConfig) -> str:
    """The architecture fields in which a node's model differs from the head's ("" if none)."""
    diffs = [
        f"{k}={getattr(node, k)!r} (head: {getattr(head, k)!r})"
        for k in head.__dataclass_fields__
        if getattr(head, k) != getattr(node, k)
    ]
    return ", ".join(diffs)


class HeadLink:
    """The node link's state and relay; `run()` is the process's main loop."""

    def __init__(self, spec: ProcSpec, ctx: zmq.Context) -> None:
        cfg, dep = spec.config, spec.deployment
        self.spec = spec
        self.num_workers = world_size(cfg)
        self.nodes = {r: self.make_node(r) for r in range(1, dep.nnodes)}
        self.owner = {rank: node for node in self.nodes.values() for rank in node.ranks}
        self.auth: Any = None
        if dep.curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(ctx)
            self.auth.start()
            self.auth.configure_curve_callback("*", NodeKeyCheck(dep.curve.public))
        self.router = link_router(ctx, spec.endpoints.link, dep.curve)
        self.plans = {pull_socket(ctx, spec.own.worker_plans[r]): r for r in self.owner}
        self.results = push_socket(ctx, spec.own.worker_result)
        self.frontend = push_socket(ctx, spec.endpoints.frontend_in)
        self.control = pull_socket(ctx, spec.endpoints.link_control)
        self.poller = zmq.Poller()
        for sock in (self.router, self.control):
            self.poller.register(sock, zmq.POLLIN)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(NodeToHead)
        self.launcher = push_socket(ctx, spec.endpoints.launcher)
        self.requested_stop = False
        self.welcomed = False
        self.all_ready = False
        self.tp = cfg.tensor_parallel_size

    def make_node(self, rank: int) -> NodeState:
        """What node `rank` runs: its block of the worker ranks."""
        dep = self.spec.deployment
        return NodeState(rank, node_ranks(self.num_workers, dep.nnodes, rank))

    # ---- sending -------------------------------------------------------------------

    def send(self, node: NodeState, msg: HeadToNode) -> None:
        """One message to a joined node; NodeLost if it is gone or not reading."""
        assert node.identity is not None
        try:
            self.router.send_multipart([node.identity, self.enc.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            raise NodeLost(node, "stopped reading the node link") from None
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            raise NodeLost(node, "disconnected from the node link") from None

    def reply(self, identity: bytes, msg: HeadToNode) -> None:
        """An answer to a Join; a peer that left meanwhile is not an error."""
        try:
            self.router.send_multipart([identity, self.enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not answer a node's join: %s", e)

    def stop_nodes(self) -> None:
        """Tells every joined node that the deployment stopped, and waits (up to
        STOP_WAIT_S) for each one's Bye, reading everything the nodes still send, so that
        closing the link afterwards does not reset the connection under the Stop."""
        why = "the head stopped" if self.requested_stop else "the head stopped after a failure"
        stop = self.enc.encode(Stop(reason=why, failed=not self.requested_stop))
        told: set[bytes] = set()
        for node in self.nodes.values():
            if node.identity is not None:
                try:
                    self.router.send_multipart([node.identity, stop], zmq.NOBLOCK)
                    told.add(node.identity)
                    log.info("told %s: %s", node.name, why)
                except zmq.ZMQError as e:
                    log.warning("could not tell %s that %s: %s", node.name, why, e)
        deadline = time.monotonic() + STOP_WAIT_S
        while told and time.monotonic() < deadline:
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) == 2 and _is_bye(self.dec, frames[1]):
                told.discard(frames[0])

    # ---- joining -------------------------------------------------------------------

    def refusal(self, msg: Join) -> str:
        """Why a Join cannot be accepted ("" if it can)."""
        dep = self.spec.deployment
        pp = self.num_workers // self.tp
        if msg.version != LINK_VERSION:
            return f"link version {msg.version} differs from the head's {LINK_VERSION}"
        if msg.nnodes != dep.nnodes:
            return f"this node has --nnodes {msg.nnodes}, the head --nnodes {dep.nnodes}"
        if msg.num_workers != self.num_workers:
            return (
                f"world size mismatch: this node counts {msg.num_workers} workers, the head "
                f"{self.num_workers} (tp {self.tp} x pp {pp}): start every node with the "
                "same --tp/--pp"
            )
        if not 1 <= msg.node_rank < dep.nnodes:
            return f"--node-rank {msg.node_rank} is not in [1, {dep.nnodes})"
        diff = model_mismatch(self.spec.model_config, msg.model)
        if diff:
            return f"model mismatch: {diff}"
        return ""

    def on_join(self, identity: bytes, msg: Join, now: float) -> None:
        """A node joins (or retries its Join). Nodes are welcomed all at once, when the
        last one has joined: a welcomed node starts its workers, whose rendezvous waits
        a bounded time for every rank."""
        reason = self.refusal(msg)
        if reason:
            log.error("refused node %d from %s: %s", msg.node_rank, msg.host, reason)
            self.reply(identity, Refused(session=msg.session, reason=reason))
            return
        node = self.nodes[msg.node_rank]
        if node.identity is not None and node.session != msg.session:
            reason = (
                f"node rank {msg.node_rank} is already part of the deployment (joined from "
                f"{node.host}, last heard {now - node.last_seen:.1f} s ago)"
            )
            self.reply(identity, Refused(session=msg.session, reason=reason, retry=True))
            return
        node.last_seen = now
        if node.identity is None:
            node.identity, node.session, node.host = identity, msg.session, msg.host
            log.info("%s joined; ranks %s", node.name, list(node.ranks))
        if self.welcomed:
            self.reply(identity, self.welcome(node))  # a retried Join: the same answer
        elif all(n.identity is not None for n in self.nodes.values()):
            self.welcomed = True
            for n in self.nodes.values():
                self.send(n, self.welcome(n))
            for sock in self.plans:
                self.poller.register(sock, zmq.POLLIN)
            self.launcher.send(self.enc.encode(NodesJoined(nnodes=self.spec.deployment.nnodes)))

    def welcome(self, node: NodeState) -> Welcome:
        return Welcome(
            session=node.session,
            config=self.spec.config,
            dist_init=self.spec.own.dist_init,
            ranks=list(node.ranks),
        )

    def check_silence(self, now: float) -> None:
        """A welcomed node that stays silent is lost; one still waiting for the others to
        join is only forgotten (it may join again)."""
        for node in self.nodes.values():
            if node.identity is None or now - node.last_seen <= NODE_TIMEOUT_S:
                continue
            silent = now - node.last_seen
            if self.welcomed:
                raise NodeLost(node, f"lost: no heartbeat for {silent:.1f} s")
            log.warning("%s left before every node joined (silent %.1f s)", node.name, silent)
            node.identity, node.session = None, ""

    # ---- serving -------------------------------------------------------------------

    def on_node_message(self, identity: bytes, frame: bytes, now: float) -> None:
        try:
            msg = self.dec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("undecodable message on the node link: %s", e)
            return
        if isinstance(msg, Join):
            self.on_join(identity, msg, now)
            return
        node = next((n for n in self.nodes.values() if n.identity == identity), None)
        if node is None:
            log.warning("ignoring a %s from a peer that has not joined", type(msg).__name__)
            return
        node.last_seen = now
        if isinstance(msg, FromWorker):
            if msg.seq != node.seq_in:
                due = node.seq_in
                raise NodeLost(node, f"lost a result frame ({msg.seq} came, {due} was due)")
            node.seq_in += 1
            self.results.send(msg.frame)
        elif isinstance(msg, NodeReady):
            node.ready, node.pids = True, dict(msg.pids)
            log.info("%s ready: %s", node.name, node.pids)
        elif isinstance(msg, NodeFailed):
            raise NodeLost(node, f"failed: {msg.reason}")

    def relay(self, events: dict[zmq.Socket, int]) -> None:
        """Forwards what the head's processes sent for the nodes (the scheduler's plans
        for remote ranks)."""
        for sock in self.plans:
            if sock in events:
                self.forward_plans(sock)

    def forward_plans(self, sock: zmq.Socket) -> None:
        rank = self.plans[sock]
        node = self.owner[rank]
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.send(node, ToWorker(rank=rank, seq=node.seq_out, frame=frame))
            node.seq_out += 1

    def status(self, now: float) -> list[dict[str, Any]]:
        """Every node's place in the deployment, for `sarazmq health`."""
        dep = self.spec.deployment
        head_ranks = node_ranks(self.num_workers, dep.nnodes, 0)
        rows: list[dict[str, Any]] = [
            {"node": 0, "host": dep.master_addr, "role": "head", "ranks": list(head_ranks)}
        ]
        for node in self.nodes.values():
            rows.append(
                {
                    "node": node.rank,
                    "host": node.host,
                    "role": "worker",
                    "ranks": list(node.ranks),
                    "joined": node.identity is not None,
                    "ready": node.ready,
                    "last_heartbeat_s": round(now - node.last_seen, 3) if node.identity else None,
                    "pids": node.pids,
                }
            )
        for row in rows:
            row["stages"] = sorted({r // self.tp for r in row["ranks"]})
        return rows

    def run(self, ready: Callable[..., None]) -> None:
        """Until a node is lost (NodeLost) or SIGTERM (Stopped)."""
        next_beat = next_status = time.monotonic()
        while True:
            events = dict(self.poller.poll(100))
            now = time.monotonic()
            if self.router in events:
                while True:
                    try:
                        identity, frame = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not [identity, frame]
                        continue
                    self.on_node_message(identity, frame, now)
            self.relay(events)
            if self.control in events:
                msg = msgspec.msgpack.decode(self.control.recv(), type=HeadStopping)
                self.requested_stop = True
                log.info("stop requested: %s", msg.reason)
            self.check_silence(now)
            if now >= next_beat and self.welcomed:
                next_beat = now + BEAT_INTERVAL_S
                for node in self.nodes.values():
                    if node.identity is not None:
                        self.send(node, Beat(time=now))
            if not self.all_ready and all(n.ready for n in self.nodes.values()):
                self.all_ready = True
                ready(nodes=self.status(now))
            if self.all_ready and now >= next_status:
                next_status = now + BEAT_INTERVAL_S
                try:
                    status = NodesStatus(nodes=self.status(now))
                    self.frontend.send(self.enc.encode(status), zmq.NOBLOCK)
                except zmq.Again:
                    pass


def tell_nodelink_stopping(ctx: zmq.Context, endpoint: str) -> None:
    """From the head's launcher, before a requested stop: the node link then tells the
    nodes that the stop is no failure (best effort)."""
    sock = push_socket(ctx, endpoint, send_timeout_ms=500)
    try:
        sock.send(msgspec.msgpack.encode(HeadStopping(reason="stop requested")))
    except zmq.ZMQError as e:
        log.warning("could not tell the node link about the stop: %s", e)
    finally:
        sock.close(linger=500)


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    run_head_link(HeadLink(spec, ctx), ctx, ready)


def run_head_link(link: HeadLink, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    """Runs a head link until SIGTERM (the nodes told to stop) or a lost node (reported to
    the launcher, the nodes told to stop, exit 1)."""
    try:
        link.run(ready)
    except NodeLost as e:
        log.error("%s", e)
        # the launcher first (it fails the in-flight requests), then the other nodes
        failed = Failed(name=f"node-{e.node_rank}", error=str(e))
        link.launcher.send(msgspec.msgpack.encode(failed))
        link.launcher.close(linger=2000)
        link.stop_nodes()
        link.router.close(linger=1000)
        ctx.destroy(linger=0)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)
    except Stopped:
        link.stop_nodes()
        link.router.close(linger=1000)
        raise
    finally:
        if link.auth is not None:
            link.auth.stop()


def lost_node_reason(
    launcher: zmq.Socket, decoder: msgspec.msgpack.Decoder, reports: list[Failed]
) -> str:
    """Why a node was lost, if the node link says so within about a heartbeat ("" if
    not): a lost node is the cause of whatever died with it (a head worker's collective
    with the node's ranks breaks at once). `reports`: the Failed messages already read."""
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        lost = [m for m in reports if m.name.startswith("node-")]
        if lost:
            return lost[0].error
        if launcher.poll(50):
            try:
                msg = decoder.decode(launcher.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # nothing a launcher message can say about the node
            if isinstance(msg, Failed):
                reports.append(msg)
    lost = [m for m in reports if m.name.startswith("node-")]
    return lost[0].error if lost else ""


if __name__ == "__main__":
    run_process(body)
