"""What the frontend's logic asks its process loop to send, and the names of why it
refused a frame or gave up on a client (fixed sets: the counters keyed by them stay
bounded however hostile the traffic)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sarazmq.protocol.client import ServerMessage
from sarazmq.protocol.engine import SchedulerInbound

ClientReply = tuple[bytes, ServerMessage]

# Kinds of rejected frames (the keys of Frontend.rejected; a fixed set, so bounded).
REJECT_UNDECODABLE = "undecodable"  # not msgpack, truncated, too deeply nested
REJECT_INVALID = "invalid"  # msgpack, but not a ClientMessage (wrong types, unknown kind)
REJECT_MULTIPART = "multipart"  # a message of more than one frame
REJECT_BAD_REQUEST = "bad_request"  # a well-formed GenerateRequest that fails validation

# Why a client was treated as gone (the keys of Frontend.clients_gone).
GONE_UNREACHABLE = "disconnected"  # a send to it failed: no such peer (EHOSTUNREACH)
GONE_TIMEOUT = "no_pong"  # answered no heartbeat for client_timeout
GONE_BACKLOG = "backlog_full"  # its queue of unsent messages is full (not reading)


@dataclass
class FrontendActions:
    """What the process loop must send after handling one input.

    to_scheduler: messages for the engine instances' schedulers; to_instance: the
    instance each one goes to (parallel to to_scheduler)."""

    to_clients: list[ClientReply] = field(default_factory=list)
    to_scheduler: list[SchedulerInbound] = field(default_factory=list)
    to_instance: list[int] = field(default_factory=list)

    def send(self, instance: int, msg: SchedulerInbound) -> None:
        self.to_scheduler.append(msg)
        self.to_instance.append(instance)

    def extend(self, other: FrontendActions) -> None:
        self.to_clients.extend(other.to_clients)
        self.to_scheduler.extend(other.to_scheduler)
        self.to_instance.extend(other.to_instance)


@dataclass
class ClientState:
    last_pong: float
    num_inflight: int = 0
