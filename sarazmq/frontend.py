"""The frontend's logic (socket-free): validate client frames, tokenize, route outputs back.

The frontend process owns the one public ROUTER socket. Clients are identified by
their ROUTER identity; each client request id is made engine-unique by prefixing the
identity, and mapped back when outputs return.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from sarazmq.protocol import (
    Abort,
    AbortRequest,
    AddRequest,
    ClientMessage,
    EngineDead,
    FrontendInbound,
    GenerateRequest,
    Heartbeat,
    OutputBatch,
    OutputDelta,
    ProtocolError,
    SchedulerInbound,
    ServerMessage,
    StatsAnswer,
    StatsQuery,
    StatsReply,
    StatsRequest,
)
from sarazmq.tokenizer_manager import TokenizerManager

log = logging.getLogger("sarazmq.frontend")

ClientReply = tuple[bytes, ServerMessage]


@dataclass
class FrontendActions:
    """What the process loop must send after handling one input."""

    to_clients: list[ClientReply] = field(default_factory=list)
    to_scheduler: list[SchedulerInbound] = field(default_factory=list)


class Frontend:
    """Client-facing request bookkeeping; no sockets, so tests drive it directly."""

    def __init__(self, tokenizer: TokenizerManager | None) -> None:
        self.tokenizer = tokenizer
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        # engine request id -> (client identity, client request id)
        self.inflight: dict[str, tuple[bytes, str]] = {}
        self.pending_stats: dict[str, tuple[bytes, str]] = {}
        self.dead_reason = ""
        self.rejected = Counter[str]()

    @staticmethod
    def engine_id(identity: bytes, client_rid: str) -> str:
        return f"{identity.hex()}/{client_rid}"

    # ---- from clients ----------------------------------------------------------------

    def on_client_frame(self, identity: bytes, frame: bytes) -> FrontendActions:
        acts = FrontendActions()
        try:
            msg = self.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self._reject(acts, identity, frame, e)
            return acts
        if isinstance(msg, GenerateRequest):
            self._on_generate(acts, identity, msg)
        elif isinstance(msg, AbortRequest):
            eid = self.engine_id(identity, msg.request_id)
            if eid in self.inflight:
                acts.to_scheduler.append(Abort(request_id=eid))
        elif isinstance(msg, StatsRequest):
            eid = self.engine_id(identity, msg.request_id)
            if self.dead_reason:
                acts.to_clients.append(
                    (identity, StatsReply(msg.request_id, {"dead": self.dead_reason}))
                )
            else:
                self.pending_stats[eid] = (identity, msg.request_id)
                acts.to_scheduler.append(
                    StatsQuery(request_id=eid, iterations_from=msg.iterations_from)
                )
        return acts

    def _reject(self, acts: FrontendActions, identity: bytes, frame: bytes, err: Exception) -> None:
        """Answers an undecodable frame: to its request id if one can be read, else generically."""
        kind = type(err).__name__
        if self.rejected[kind] == 0:
            log.warning("rejected a client frame (%s): %s", kind, err)
        self.rejected[kind] += 1
        rid = None
        try:
            raw = msgspec.msgpack.decode(frame)
            if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
                rid = raw["request_id"]
        except Exception:  # noqa: BLE001 - any garbage is just "no id"
            rid = None
        text = f"invalid request: {err}"
        if rid is not None:
            acts.to_clients.append(
                (identity, OutputDelta(request_id=rid, finish_reason="error", error=text))
            )
        else:
            acts.to_clients.append((identity, ProtocolError(error=text)))

    def _on_generate(self, acts: FrontendActions, identity: bytes, msg: GenerateRequest) -> None:
        eid = self.engine_id(identity, msg.request_id)

        def fail(error: str) -> None:
            acts.to_clients.append(
                (
                    identity,
                    OutputDelta(request_id=msg.request_id, finish_reason="error", error=error),
                )
            )

        if self.dead_reason:
            return fail(f"engine is down: {self.dead_reason}")
        if eid in self.inflight:
            return fail(f"request_id {msg.request_id!r} is already in flight")
        given = [x is not None for x in (msg.prompt, msg.prompt_token_ids, msg.messages)]
        if sum(given) != 1:
            return fail("exactly one of prompt, prompt_token_ids or messages must be given")
        if self.tokenizer is None:
            return fail("engine has no tokenizer")
        try:
            if msg.messages is not None:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in msg.messages]
                )
            elif msg.prompt is not None:
                ids = self.tokenizer.encode(msg.prompt)
            else:
                ids = self.tokenizer.encode(msg.prompt_token_ids or [])
        except ValueError as e:
            return fail(str(e))
        self.inflight[eid] = (identity, msg.request_id)
        acts.to_scheduler.append(
            AddRequest(
                request_id=eid,
                prompt_token_ids=ids,
                params=msg.params,
                arrival_time=time.monotonic(),
            )
        )
        return None

    def on_client_gone(self, identity: bytes) -> FrontendActions:
        """A client disconnected: abort everything it had in flight (frees KV blocks)."""
        acts = FrontendActions()
        for eid, (ident, _) in list(self.inflight.items()):
            if ident == identity:
                acts.to_scheduler.append(Abort(request_id=eid))
        return acts

    # ---- from the engine -------------------------------------------------------------

    def on_engine_message(self, msg: FrontendInbound) -> FrontendActions:
        acts = FrontendActions()
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                route = (self.inflight.pop if out.finish_reason else self.inflight.get)(
                    out.request_id, None
                )
                if route is None:
                    continue  # client request already failed/aborted and forgotten
                identity, client_rid = route
                out.request_id = client_rid
                acts.to_clients.append((identity, out))
        elif isinstance(msg, StatsAnswer):
            route = self.pending_stats.pop(msg.request_id, None)
            if route is not None:
                acts.to_clients.append((route[0], StatsReply(route[1], msg.stats)))
        elif isinstance(msg, EngineDead):
            self.dead_reason = msg.reason
            err = f"engine failed: {msg.reason}"
            for identity, client_rid in self.inflight.values():
                acts.to_clients.append(
                    (identity, OutputDelta(request_id=client_rid, finish_reason="error", error=err))
                )
            self.inflight.clear()
            for identity, client_rid in self.pending_stats.values():
                acts.to_clients.append((identity, StatsReply(client_rid, {"dead": msg.reason})))
            self.pending_stats.clear()
        return acts

    def heartbeats(self) -> list[ClientReply]:
        """One heartbeat per client with requests in flight."""
        now = time.monotonic()
        idents = {ident for ident, _ in self.inflight.values()}
        idents.update(ident for ident, _ in self.pending_stats.values())
        return [(ident, Heartbeat(time=now)) for ident in idents]
