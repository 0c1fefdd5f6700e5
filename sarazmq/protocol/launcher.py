"""Every process -> the launcher (READY, a failed start, the end of a drain), and the node
link between the head and the other nodes of a multi-node deployment."""

from __future__ import annotations

from typing import Any

import msgspec

from sarazmq.config import EngineConfig, ModelConfig


class Ready(msgspec.Struct, tag="ready", array_like=True):
    name: str
    pid: int
    info: dict[str, Any] = {}


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A process could not start (bad model, tp mismatch, ...): the reason, for the user."""

    name: str
    error: str


class Drained(msgspec.Struct, tag="drained", array_like=True):
    """From the frontend: after a `Drain`, no request is in flight any more."""

    num_finished: int
    num_aborted: int


class NodesJoined(msgspec.Struct, tag="nodes_joined", array_like=True):
    """From the head's node link: every other node has joined (and been welcomed), so
    the head's workers can start: torch.distributed's rendezvous, which rank 0 hosts,
    waits a bounded time for every rank."""

    nnodes: int


LauncherInbound = Ready | Failed | Drained | NodesJoined


# ---- the node link: a node's agent (DEALER) <-> the head's nodelink process (ROUTER) ----
#
# One tcp connection per node, CurveZMQ-encrypted (and authenticated: every node holds
# the deployment's keypair). A node sends `Join` until answered; the head answers
# `Welcome` (then the node starts its workers and says `NodeReady`) or `Refused`. Then
# plans for the node's ranks go head -> node (`ToWorker`), results node -> head
# (`FromWorker`), each numbered so that a lost frame is an error, not a hang; both sides
# send `Beat` every second and treat a silent peer as gone.

#
# With data-parallel replicas (`--dp N`, N a multiple of the node count), each node runs
# whole replicas instead (scheduler, workers, detokenizers: `Welcome.instances`); the
# head's frontend reaches their schedulers through the link (`ToInstance`), and what
# their schedulers and detokenizers send the frontend comes back (`FromInstance`). A node
# lost then takes only its replicas down, and a node that joins again brings them back.

#: Bumped on any change to the link messages; a node of another version is refused.
LINK_VERSION = 2


class Join(msgspec.Struct, tag="join", array_like=True):
    """Node -> head: asks to join. session: random per attempt (a retried Join is
    recognised); num_workers: the node's idea of the world size (tp x pp);
    model: the model's architecture, which must match the head's."""

    version: int
    node_rank: int
    nnodes: int
    num_workers: int
    session: str
    host: str
    model: ModelConfig
    num_instances: int = 1


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """Head -> node: joined. config: the head's resolved engine config (the node keeps
    its own model path and thread count); dist_init: torch.distributed's init
    method; ranks: the global worker ranks this node runs; instances: with data-parallel
    replicas, the replicas this node runs whole (ranks is then empty)."""

    session: str
    config: EngineConfig
    dist_init: str
    ranks: list[int]
    instances: list[int] = []


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """Head -> node: not joined, and why. retry: the cause may pass (the rank is still
    held by a node the head has not yet seen go), so the node may ask again."""

    session: str
    reason: str
    retry: bool = False


class NodeReady(msgspec.Struct, tag="node_ready", array_like=True):
    """Node -> head: every worker of the node said READY (name -> pid)."""

    pids: dict[str, int]


class Beat(msgspec.Struct, tag="beat", array_like=True):
    """Either way, every second: the sender is alive."""

    time: float


class ToWorker(msgspec.Struct, tag="to_worker", array_like=True):
    """Head -> node: one frame from the scheduler for worker `rank`; seq counts the frames
    sent to this node (0, 1, ...)."""

    rank: int
    seq: int
    frame: bytes


class FromWorker(msgspec.Struct, tag="from_worker", array_like=True):
    """Node -> head: one frame from a worker of the node to the scheduler (a result)."""

    seq: int
    frame: bytes


class ToInstance(msgspec.Struct, tag="to_instance", array_like=True):
    """Head -> node: one frame from the frontend for the scheduler of replica `instance`;
    seq counts the frames sent to this node (0, 1, ...)."""

    instance: int
    seq: int
    frame: bytes


class FromInstance(msgspec.Struct, tag="from_instance", array_like=True):
    """Node -> head: one frame from a replica of the node to the frontend (outputs, stats
    answers, load reports)."""

    seq: int
    frame: bytes


class NodeFailed(msgspec.Struct, tag="node_failed", array_like=True):
    """Node -> head: the node cannot go on (a worker died, it was told to stop)."""

    reason: str


class Bye(msgspec.Struct, tag="bye", array_like=True):
    """Node -> head: the answer to `Stop`. The head reads it before it closes the link:
    a tcp socket closed with unread data sends a reset, which can make the peer's kernel
    drop the last message (the Stop itself) before the node has read it."""


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Head -> node: the deployment stopped; failed: after a failure (a node with restart
    on-failure then joins again), not on request."""

    reason: str
    failed: bool


class HeadStopping(msgspec.Struct, tag="head_stopping", array_like=True):
    """Launcher -> its nodelink process, before a requested stop: tell the nodes it is
    not a failure."""

    reason: str


NodeToHead = Join | NodeReady | Beat | FromWorker | FromInstance | NodeFailed | Bye
HeadToNode = Welcome | Refused | Beat | ToWorker | ToInstance | Stop
