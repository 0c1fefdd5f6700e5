"""The head's end of the node link for data-parallel replicas on several machines.

`sarazmq serve --dp N --nnodes K` runs N/K whole replicas (scheduler, workers,
detokenizers) on every node; the head runs its own share, the frontend, and this process
(instead of `nodelink`, whose node link it shares: joins, keys, heartbeats). Each node is
welcomed as soon as it joins, with the replicas it runs (`Welcome.instances`). This
process binds the scheduler sockets of the remote replicas on the head, so the frontend
talks to every replica alike, and relays their frames to the node (`ToInstance`); what a
node's replicas send the frontend comes back (`FromInstance`) and is pushed to it.

A node that fails, goes silent for NODE_TIMEOUT_S or loses a frame takes only its own
replicas down: the frontend is told (`InstanceDown`, which re-routes their requests that
have streamed nothing), the node is told to stop (failed), and its place is free; when it
joins again (`--restart on-failure` on the node) and its replicas are ready, the frontend
is told they are back (`InstanceUp`). Before every node is ready the first time, a lost
node fails the deployment's start, as without replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from sarazmq.procs.common import ProcSpec, run_process
from sarazmq.procs.endpoints import node_instances
from sarazmq.procs.nodelink import NODE_TIMEOUT_S, HeadLink, NodeLost, NodeState, run_head_link
from sarazmq.procs.sockets import pull_socket
from sarazmq.protocol.engine import InstanceDown, InstanceUp
from sarazmq.protocol.launcher import (
    FromInstance,
    FromWorker,
    Join,
    NodeFailed,
    NodeReady,
    Refused,
    Stop,
    ToInstance,
    Welcome,
)

log = logging.getLogger("sarazmq.replicalink")


class ReplicaHeadLink(HeadLink):
    """The node link when the nodes run whole replicas (see the module docstring)."""

    def __init__(self, spec: ProcSpec, ctx: zmq.Context) -> None:
        super().__init__(spec, ctx)
        self.welcomed = True  # nodes are welcomed one by one, as they join
        # the remote replicas' scheduler sockets on the head (the frontend pushes there)
        self.instance_in: dict[zmq.Socket, int] = {}
        self.instance_owner: dict[int, NodeState] = {}
        for node in self.nodes.values():
            for i in node.instances:
                sock = pull_socket(ctx, spec.endpoints.instances[i].scheduler_in)
                self.instance_in[sock] = i
                self.instance_owner[i] = node
                self.poller.register(sock, zmq.POLLIN)

    def make_node(self, rank: int) -> NodeState:
        dep = self.spec.deployment
        instances = node_instances(self.spec.config.data_parallel_size, dep.nnodes, rank)
        return NodeState(rank, range(0), instances=list(instances))

    def refusal(self, msg: Join) -> str:
        reason = super().refusal(msg)
        if reason:
            return reason
        dp = self.spec.config.data_parallel_size
        if msg.num_instances != dp:
            return f"this node has --dp {msg.num_instances}, the head --dp {dp}"
        return ""

    def on_join(self, identity: bytes, msg: Join, now: float) -> None:
        """A node joins (or retries its Join): welcomed at once with its replicas."""
        reason = self.refusal(msg)
        if reason:
            log.error("refused node %d from %s: %s", msg.node_rank, msg.host, reason)
            self.reply(identity, Refused(session=msg.session, reason=reason))
            return
        node = self.nodes[msg.node_rank]
        if node.identity is not None and node.session != msg.session:
            why = f"node rank {msg.node_rank} is already part of the deployment"
            self.reply(identity, Refused(session=msg.session, reason=why, retry=True))
            return
        node.last_seen = now
        if node.identity is None:
            node.identity, node.session, node.host = identity, msg.session, msg.host
            node.seq_in = node.seq_out = 0
            log.info("%s joined; replicas %s", node.name, node.instances)
        self.reply(identity, self.welcome(node))

    def welcome(self, node: NodeState) -> Welcome:
        return Welcome(
            session=node.session,
            config=self.spec.config,
            dist_init="",
            ranks=[],
            instances=list(node.instances),
        )

    def send(self, node: NodeState, msg: Any) -> None:
        try:
            super().send(node, msg)
        except NodeLost as e:
            self.lose(node, str(e).removeprefix(node.name + " "))

    def check_silence(self, now: float) -> None:
        for node in self.nodes.values():
            if node.identity is not None and now - node.last_seen > NODE_TIMEOUT_S:
                self.lose(node, f"lost: no heartbeat for {now - node.last_seen:.1f} s")

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
            return  # a node already let go (its late frames) or a stranger
        node.last_seen = now
        if isinstance(msg, FromInstance):
            if msg.seq != node.seq_in:
                self.lose(node, f"lost a frame ({msg.seq} came, {node.seq_in} was due)")
                return
            node.seq_in += 1
            self.frontend.send(msg.frame)
        elif isinstance(msg, NodeReady):
            node.ready, node.pids = True, dict(msg.pids)
            log.info("%s ready: %s", node.name, node.pids)
            if self.all_ready:  # a node that joined again: its replicas serve again
                for i in node.instances:
                    self.frontend.send(self.enc.encode(InstanceUp(instance=i)))
        elif isinstance(msg, NodeFailed):
            self.lose(node, f"failed: {msg.reason}")
        elif isinstance(msg, FromWorker):
            log.warning("ignoring a worker frame from %s (it runs whole replicas)", node.name)

    def lose(self, node: NodeState, why: str) -> None:
        """`node` cannot serve: its replicas go down (NodeLost before the deployment
        first served: the start fails), it is told to stop, its place is free."""
        if not self.all_ready:
            raise NodeLost(node, why)
        reason = f"{node.name} {why}"
        log.error("%s; its replicas %s are down", reason, node.instances)
        for i in node.instances:
            self.frontend.send(self.enc.encode(InstanceDown(instance=i, reason=reason)))
        if node.identity is not None:
            stop = self.enc.encode(Stop(reason=reason, failed=True))
            try:
                self.router.send_multipart([node.identity, stop], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # it is gone: its silence already says so
        node.identity, node.session, node.ready, node.pids = None, "", False, {}

    def relay(self, events: dict[zmq.Socket, int]) -> None:
        """The frontend's frames for remote replicas, to their node (dropped while the
        node is down: the frontend routes nothing there, and aborts need no answer)."""
        for sock, instance in self.instance_in.items():
            if sock not in events:
                continue
            node = self.instance_owner[instance]
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if node.identity is None:
                    continue
                self.send(node, ToInstance(instance=instance, seq=node.seq_out, frame=frame))
                node.seq_out += 1

    def status(self, now: float) -> list[dict[str, Any]]:
        dep = self.spec.deployment
        dp = self.spec.config.data_parallel_size
        rows: list[dict[str, Any]] = [
            {
                "node": 0,
                "host": dep.master_addr,
                "role": "head",
                "replicas": list(node_instances(dp, dep.nnodes, 0)),
            }
        ]
        for node in self.nodes.values():
            rows.append(
                {
                    "node": node.rank,
                    "host": node.host,
                    "role": "replicas",
                    "replicas": node.instances,
                    "joined": node.identity is not None,
                    "ready": node.ready,
                    "last_heartbeat_s": round(now - node.last_seen, 3) if node.identity else None,
                    "pids": node.pids,
                }
            )
        return rows


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    run_head_link(ReplicaHeadLink(spec, ctx), ctx, ready)


if __name__ == "__main__":
    run_process(body)
