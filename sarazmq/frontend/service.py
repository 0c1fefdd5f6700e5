"""The frontend process's logic (socket-free): validate client frames, tokenize, route outputs back.

The frontend process owns the one public ROUTER socket. Clients are identified by
their ROUTER identity; each client request id is made engine-unique by prefixing the
identity, and mapped back when outputs return.

Everything a client sends is untrusted: a frame that cannot be decoded into a
`ClientMessage` is answered with an error (to its request id when one can be read,
else a `ProtocolError`), counted by kind and logged once per kind; nothing it contains
can make this class raise or keep state for it. A client that goes away (disconnects,
stops answering heartbeats, or cannot take its output) has its requests aborted, which
frees their KV blocks.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sarazmq.config import DEFAULT_CLIENT_TIMEOUT_S
from sarazmq.frontend.prompts import PromptTokenizer
from sarazmq.protocol.client import (
    AbortRequest,
    ClientMessage,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ProtocolError,
    ResetPrefixCacheRequest,
    ServerMessage,
    StatsReply,
    StatsRequest,
)
from sarazmq.protocol.common import (
    ERROR_ENGINE,
    ERROR_INVALID,
    ERROR_OVERLOADED,
    FINISH_ABORT,
    FINISH_ERROR,
    ErrorType,
)
from sarazmq.protocol.engine import (
    Abort,
    AddRequest,
    Drain,
    EngineDead,
    FrontendInbound,
    NodesStatus,
    OutputBatch,
    ResetPrefixCache,
    SchedulerInbound,
    StatsAnswer,
    StatsQuery,
)
from sarazmq.validation import InvalidRequestError, find_invalid_field

log = logging.getLogger("sarazmq.frontend")

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
    """What the process loop must send after handling one input."""

    to_clients: list[ClientReply] = field(default_factory=list)
    to_scheduler: list[SchedulerInbound] = field(default_factory=list)


@dataclass
class _Route:
    """Where one engine request's outputs go."""

    identity: bytes
    client_rid: str
    # attached to the first output, then dropped (the client needs them once)
    prompt_token_ids: list[int] | None


@dataclass
class _ClientState:
    last_pong: float
    num_inflight: int = 0


class FrontendService:
    """Client-facing request bookkeeping; no sockets, so tests drive it directly.

    client_timeout: seconds a client with requests in flight may go without answering
        a heartbeat before it is treated as gone (its requests aborted); see
        `DeploymentConfig.client_timeout`.
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        *,
        client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S,
        clock: Any = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.client_timeout = client_timeout
        self.clock = clock
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        # engine request id -> where its outputs go
        self.inflight: dict[str, _Route] = {}
        self.pending_stats: dict[str, tuple[bytes, str]] = {}
        self.clients: dict[bytes, _ClientState] = {}
        self.dead_reason = ""
        # multi-node deployments: the latest NodesStatus (merged into stats replies)
        self.nodes: list[dict[str, Any]] = []
        self.draining = False
        self.drain_deadline = 0.0
        self.drain_aborted = 0
        self.drain_finished = 0
        self._drain_abort_sent = False
        # counters (fixed key sets: bounded however hostile the traffic)
        self.num_frames = 0
        self.num_pongs = 0
        self.num_accepted = 0
        self.rejected = Counter[str]()
        self.clients_gone = Counter[str]()
        self.num_aborted_for_gone_clients = 0

    @staticmethod
    def engine_id(identity: bytes, client_rid: str) -> str:
        return f"{identity.hex()}/{client_rid}"

    def counters(self) -> dict[str, Any]:
        """The frontend's own statistics (merged into every stats reply as "frontend")."""
        return {
            "num_frames": self.num_frames,
            "num_pongs": self.num_pongs,
            "num_accepted": self.num_accepted,
            "rejected": dict(self.rejected),
            "clients_gone": dict(self.clients_gone),
            "num_aborted_for_gone_clients": self.num_aborted_for_gone_clients,
            "num_clients": len(self.clients),
            "num_inflight": len(self.inflight),
            "draining": self.draining,
        }

    # ---- from clients ----------------------------------------------------------------

    def on_client_frame(self, identity: bytes, frame: bytes) -> FrontendActions:
        """Handles one single-frame message from a client; never raises on its content."""
        acts = FrontendActions()
        self.num_frames += 1
        try:
            msg = self.decoder.decode(frame)
        except msgspec.ValidationError as e:
            self._reject(acts, identity, frame, REJECT_INVALID, e)
            return acts
        except Exception as e:  # noqa: BLE001 - DecodeError, RecursionError, ...: all garbage
            self._reject(acts, identity, frame, REJECT_UNDECODABLE, e)
            return acts
        if isinstance(msg, GenerateRequest):
            self._on_generate(acts, identity, msg)
        elif isinstance(msg, Pong):
            self.num_pongs += 1
            state = self.clients.get(identity)
            if state is not None:
                state.last_pong = self.clock()
        elif isinstance(msg, AbortRequest):
            eid = self.engine_id(identity, msg.request_id)
            if eid in self.inflight:
                acts.to_scheduler.append(Abort(request_id=eid))
        elif isinstance(msg, (StatsRequest, ResetPrefixCacheRequest)):
            eid = self.engine_id(identity, msg.request_id)
            if self.dead_reason:
                stats = {"dead": self.dead_reason, "frontend": self.counters()}
                acts.to_clients.append((identity, StatsReply(msg.request_id, stats)))
            elif eid not in self.pending_stats:
                self.pending_stats[eid] = (identity, msg.request_id)
                acts.to_scheduler.append(
                    StatsQuery(request_id=eid, iterations_from=msg.iterations_from)
                    if isinstance(msg, StatsRequest)
                    else ResetPrefixCache(request_id=eid)
                )
        return acts

    def reject_frame(self, identity: bytes, kind: str, error: str) -> FrontendActions:
        """A message the process loop refused before decoding (e.g. several frames)."""
        acts = FrontendActions()
        self.num_frames += 1
        self._count_rejection(kind, error)
        acts.to_clients.append((identity, ProtocolError(error=f"invalid message: {error}")))
        return acts

    def _count_rejection(self, kind: str, error: str) -> None:
        if self.rejected[kind] == 0:
            log.warning(
                "rejected a client message (%s): %s (further ones are counted)", kind, error
            )
        self.rejected[kind] += 1

    def _reject(
        self, acts: FrontendActions, identity: bytes, frame: bytes, kind: str, err: Exception
    ) -> None:
        """Answers an undecodable frame: to its request id if one can be read, else generically.

        A frame that is msgpack but not a valid `ClientMessage` is walked against the
        expected type to name the offending field (`find_invalid_field`)."""
        rid = None
        invalid: InvalidRequestError | None = None
        if kind == REJECT_INVALID:  # undecodable frames have no readable id by definition
            try:
                raw = msgspec.msgpack.decode(frame)
            except Exception:  # noqa: BLE001 - any garbage is just "no id"
                raw = None
            if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
                rid = raw["request_id"][:256]
            if raw is not None:
                invalid = find_invalid_field(raw, ClientMessage)
        if invalid is not None:
            where = f" ({invalid.field})" if invalid.field else ""
            text = f"invalid request{where}: {invalid.message}"[:1000]
        else:
            text = f"invalid request: {type(err).__name__}: {err}"[:1000]
        self._count_rejection(kind, text)
        if rid is not None:
            reply = OutputDelta(
                request_id=rid,
                finish_reason=FINISH_ERROR,
                error=text,
                error_field=invalid.field if invalid is not None else "",
                error_type=ERROR_INVALID,
            )
            acts.to_clients.append((identity, reply))
        else:
            acts.to_clients.append((identity, ProtocolError(error=text)))

    def _on_generate(self, acts: FrontendActions, identity: bytes, msg: GenerateRequest) -> None:
        eid = self.engine_id(identity, msg.request_id)

        def fail(error: str, field_name: str = "", error_type: ErrorType = ERROR_INVALID) -> None:
            self._count_rejection(REJECT_BAD_REQUEST, error)
            reply = OutputDelta(
                request_id=msg.request_id,
                finish_reason=FINISH_ERROR,
                error=error,
                error_field=field_name,
                error_type=error_type,
            )
            acts.to_clients.append((identity, reply))

        if self.dead_reason:
            return fail(f"engine is down: {self.dead_reason}", error_type=ERROR_ENGINE)
        if self.draining:
            return fail(
                "engine is shutting down: not accepting new requests",
                error_type=ERROR_OVERLOADED,
            )
        if eid in self.inflight:
            return fail(f"request_id {msg.request_id!r} is already in flight", "request_id")
        given = [
            name
            for name, value in (
                ("prompt", msg.prompt),
                ("prompt_token_ids", msg.prompt_token_ids),
                ("messages", msg.messages),
            )
            if value is not None
        ]
        if len(given) != 1:
            return fail(
                "exactly one of prompt, prompt_token_ids or messages must be given",
                given[-1] if given else "prompt",
            )
        if self.tokenizer is None:
            return fail("engine has no tokenizer", error_type=ERROR_ENGINE)
        try:
            if msg.messages is not None:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in msg.messages]
                )
            elif msg.prompt is not None:
                ids = self.tokenizer.encode(msg.prompt)
            else:
                ids = self.tokenizer.check(msg.prompt_token_ids or [], "prompt_token_ids")
        except InvalidRequestError as e:
            return fail(e.message, e.field)
        self.num_accepted += 1
        self.inflight[eid] = _Route(identity, msg.request_id, ids)
        state = self.clients.get(identity)
        if state is None:
            state = self.clients[identity] = _ClientState(last_pong=self.clock())
        state.num_inflight += 1
        acts.to_scheduler.append(
            AddRequest(
                request_id=eid,
                prompt_token_ids=ids,
                params=msg.params,
                arrival_time=self.clock(),
            )
        )
        return None

    def on_client_gone(self, identity: bytes, reason: str = GONE_UNREACHABLE) -> FrontendActions:
        """A client went away: abort everything it had in flight (frees KV blocks) and
        forget it, so nothing more is sent to it."""
        acts = FrontendActions()
        n = 0
        for eid, route in list(self.inflight.items()):
            if route.identity == identity:
                acts.to_scheduler.append(Abort(request_id=eid))
                del self.inflight[eid]
                n += 1
        for eid, (ident, _) in list(self.pending_stats.items()):
            if ident == identity:
                del self.pending_stats[eid]
        if self.clients.pop(identity, None) is not None or n:
            self.clients_gone[reason] += 1
            self.num_aborted_for_gone_clients += n
            if n:
                log.info("client %s gone (%s): aborted %d request(s)", identity.hex(), reason, n)
        return acts

    def expired_clients(self) -> list[bytes]:
        """Clients with requests in flight that answered no heartbeat for client_timeout."""
        limit = self.clock() - self.client_timeout
        return [
            ident
            for ident, state in self.clients.items()
            if state.num_inflight and state.last_pong < limit
        ]

    # ---- from the engine -------------------------------------------------------------

    def _release(self, route: _Route) -> None:
        state = self.clients.get(route.identity)
        if state is not None:
            state.num_inflight -= 1
            if state.num_inflight <= 0:
                del self.clients[route.identity]

    def on_engine_message(self, msg: FrontendInbound) -> FrontendActions:
        acts = FrontendActions()
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                if out.finish_reason:
                    route = self.inflight.pop(out.request_id, None)
                    if route is not None:
                        self._release(route)
                        if self.draining:
                            if out.finish_reason == FINISH_ABORT:
                                self.drain_aborted += 1
                            else:
                                self.drain_finished += 1
                else:
                    route = self.inflight.get(out.request_id)
                if route is None:
                    continue  # client request already failed/aborted and forgotten
                out.request_id = route.client_rid
                if route.prompt_token_ids is not None:
                    out.prompt_token_ids = route.prompt_token_ids
                    route.prompt_token_ids = None
                acts.to_clients.append((route.identity, out))
        elif isinstance(msg, StatsAnswer):
            route_s = self.pending_stats.pop(msg.request_id, None)
            if route_s is not None:
                stats = dict(msg.stats)
                stats["frontend"] = self.counters()
                if self.nodes:
                    stats["nodes"] = self.nodes
                acts.to_clients.append((route_s[0], StatsReply(route_s[1], stats)))
        elif isinstance(msg, NodesStatus):
            self.nodes = msg.nodes
        elif isinstance(msg, EngineDead):
            self.dead_reason = msg.reason
            err = f"engine failed: {msg.reason}"
            for route in self.inflight.values():
                reply = OutputDelta(
                    request_id=route.client_rid,
                    finish_reason=FINISH_ERROR,
                    error=err,
                    error_type=ERROR_ENGINE,
                )
                acts.to_clients.append((route.identity, reply))
            self.inflight.clear()
            self.clients.clear()
            for identity, client_rid in self.pending_stats.values():
                acts.to_clients.append((identity, StatsReply(client_rid, {"dead": msg.reason})))
            self.pending_stats.clear()
        elif isinstance(msg, Drain):
            if not self.draining:
                log.info(
                    "draining: %d request(s) in flight, %.1f s to finish",
                    len(self.inflight),
                    msg.timeout,
                )
            self.draining = True
            self.drain_deadline = self.clock() + msg.timeout
        return acts

    # ---- time ------------------------------------------------------------------------

    def heartbeats(self) -> list[ClientReply]:
        """One heartbeat per client with requests in flight."""
        now = self.clock()
        idents = {route.identity for route in self.inflight.values()}
        idents.update(ident for ident, _ in self.pending_stats.values())
        return [(ident, Heartbeat(time=now)) for ident in idents]

    def drain_tick(self) -> FrontendActions:
        """Past the drain deadline, aborts whatever is still in flight (once)."""
        acts = FrontendActions()
        if self.draining and not self._drain_abort_sent and self.clock() >= self.drain_deadline:
            self._drain_abort_sent = True
            for eid in self.inflight:
                acts.to_scheduler.append(Abort(request_id=eid))
        return acts

    @property
    def drained(self) -> bool:
        """Draining and nothing is in flight any more."""
        return self.draining and not self.inflight
