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
from typing import Any

import msgspec

from sarazmq.config import DEFAULT_CLIENT_TIMEOUT_S
from sarazmq.frontend.actions import (
    GONE_UNREACHABLE,
    REJECT_BAD_REQUEST,
    REJECT_INVALID,
    REJECT_UNDECODABLE,
    ClientReply,
    ClientState,
    FrontendActions,
)
from sarazmq.frontend.fanout import Fanout, fan_out, split_part_id
from sarazmq.frontend.prompts import PromptTokenizer
from sarazmq.frontend.rejects import handler_failed_reply, invalid_frame_reply
from sarazmq.frontend.routes import Route, Routes, engine_id
from sarazmq.protocol.client import (
    AbortRequest,
    ClientMessage,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ProtocolError,
    ResetPrefixCacheRequest,
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
    HandOff,
    InstanceDown,
    InstanceLoad,
    InstanceUp,
    KVDone,
    NodesStatus,
    OutputBatch,
    ReleaseKV,
    SourceDown,
    StatsAnswer,
)
from sarazmq.router import NoInstanceError, Router
from sarazmq.validation import InvalidRequestError

log = logging.getLogger("sarazmq.frontend")


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
        router: Router | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.client_timeout = client_timeout
        self.clock = clock
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        # the requests in flight and where they run (`routes`)
        self.routes = Routes(router)
        self.router = self.routes.router
        self.num_instances = self.routes.num_instances
        # engine id of a client's stats/reset question -> its fan-out to the instances
        self.pending_stats: dict[str, Fanout] = {}
        self.clients: dict[bytes, ClientState] = {}
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

    engine_id = staticmethod(engine_id)

    @property
    def inflight(self) -> dict[str, Route]:
        """Engine request id -> where its outputs go (`Routes.inflight`)."""
        return self.routes.inflight

    def counters(self) -> dict[str, Any]:
        """The frontend's own statistics (merged into every stats reply as "frontend");
        with several instances, the router's too ("router")."""
        extra: dict[str, Any] = {}
        if self.num_instances > 1:
            extra = {"router": self.router.counters(), "num_rerouted": self.routes.num_rerouted}
        return extra | {
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
            current = self.routes.current_id(eid)
            route = self.inflight.get(current)
            if route is not None:
                route.aborted = True
                acts.send(route.instance, Abort(request_id=current))
        elif isinstance(msg, (StatsRequest, ResetPrefixCacheRequest)):
            self._on_stats(acts, identity, msg)
        return acts

    def _on_stats(
        self,
        acts: FrontendActions,
        identity: bytes,
        msg: StatsRequest | ResetPrefixCacheRequest,
    ) -> None:
        """Asks every live instance (see `fanout`); answers at once when none is up."""
        eid = self.engine_id(identity, msg.request_id)
        live = self.routes.live_instances()
        if self.dead_reason or not live:
            reason = self.dead_reason or "no engine instance is up"
            stats = {"dead": reason, "frontend": self.counters()}
            acts.to_clients.append((identity, StatsReply(msg.request_id, stats)))
            return
        if eid in self.pending_stats:
            return
        fan, parts = fan_out(identity, msg, eid, live, self.num_instances)
        self.pending_stats[eid] = fan
        for i, part in parts:
            acts.send(i, part)

    def reject_frame(self, identity: bytes, kind: str, error: str) -> FrontendActions:
        """A message the process loop refused before decoding (e.g. several frames)."""
        acts = FrontendActions()
        self.num_frames += 1
        self._count_rejection(kind, error)
        acts.to_clients.append((identity, ProtocolError(error=f"invalid message: {error}")))
        return acts

    def handler_failed(self, identity: bytes, frame: bytes, err: Exception) -> FrontendActions:
        """The answer to a frame whose handling raised (a bug here, not the sender's
        input): an engine error to its request id where one can be read, else a
        `ProtocolError` (`rejects.handler_failed_reply`), so that the sender is answered
        instead of waiting for its timeout."""
        acts = FrontendActions()
        acts.to_clients.append((identity, handler_failed_reply(frame, err)))
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
        """Answers an undecodable frame (`invalid_frame_reply`) and counts it."""
        reply, text = invalid_frame_reply(frame, kind, err)
        self._count_rejection(kind, text)
        acts.to_clients.append((identity, reply))

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
        if self.routes.has(eid):
            return fail(f"request_id {msg.request_id!r} is already in flight", "request_id")
        if not msg.request_id.isprintable():
            return fail("request_id must be printable (no control characters)", "request_id")
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
        except Exception as e:  # noqa: BLE001 - a tokenizer failure is this request's error
            log.exception("tokenizing request %r failed", msg.request_id)
            return fail(f"the engine could not tokenize the prompt: {e}", error_type=ERROR_ENGINE)
        add = AddRequest(
            request_id=eid, prompt_token_ids=ids, params=msg.params, arrival_time=self.clock()
        )
        try:
            instance = self.routes.route(add)
        except NoInstanceError as e:
            return fail(f"engine is down: {e}", error_type=ERROR_ENGINE)
        self.num_accepted += 1
        self.routes.add(add, identity, msg.request_id, instance)
        state = self.clients.get(identity)
        if state is None:
            state = self.clients[identity] = ClientState(last_pong=self.clock())
        state.num_inflight += 1
        acts.send(instance, add)
        return None

    def on_client_gone(self, identity: bytes, reason: str = GONE_UNREACHABLE) -> FrontendActions:
        """A client went away: abort everything it had in flight (frees KV blocks) and
        forget it, so nothing more is sent to it."""
        acts = FrontendActions()
        n = 0
        for eid, route in list(self.inflight.items()):
            if route.identity == identity:
                acts.send(route.instance, Abort(request_id=eid))
                self.routes.forget(eid, route)
                self._end_transfer(acts, eid, route, abort=False)
                n += 1
        for eid, fan in list(self.pending_stats.items()):
            if fan.identity == identity:
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

    def _release(self, route: Route) -> None:
        state = self.clients.get(route.identity)
        if state is not None:
            state.num_inflight -= 1
            if state.num_inflight <= 0:
                del self.clients[route.identity]

    def on_engine_message(self, msg: FrontendInbound) -> FrontendActions:
        acts = FrontendActions()
        if isinstance(msg, OutputBatch):
            self._on_outputs(acts, msg)
        elif isinstance(msg, StatsAnswer):
            self._on_stats_answer(acts, msg)
        elif isinstance(msg, InstanceLoad):
            self.router.table.on_report(msg)
        elif isinstance(msg, HandOff):
            self._on_hand_off(acts, msg)
        elif isinstance(msg, KVDone):
            self._on_kv_done(acts, msg)
        elif isinstance(msg, InstanceDown):
            self._on_instance_down(acts, msg)
        elif isinstance(msg, InstanceUp):
            if 0 <= msg.instance < self.num_instances:
                self.router.mark_up(msg.instance)
                log.warning("instance %d is up again", msg.instance)
        elif isinstance(msg, NodesStatus):
            self.nodes = msg.nodes
        elif isinstance(msg, EngineDead):
            self._on_engine_dead(acts, msg.reason)
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

    def _on_outputs(self, acts: FrontendActions, msg: OutputBatch) -> None:
        for out in msg.outputs:
            if out.finish_reason:
                route = self.inflight.get(out.request_id)
                if route is not None:
                    self.routes.forget(out.request_id, route)
                    self._release(route)
                    self._end_transfer(acts, out.request_id, route)
                    if self.draining:
                        if out.finish_reason == FINISH_ABORT:
                            self.drain_aborted += 1
                        else:
                            self.drain_finished += 1
            else:
                route = self.inflight.get(out.request_id)
            if route is None:
                continue  # client request already failed/aborted and forgotten
            route.add = None  # it has streamed: no other instance may take it over now
            out.request_id = route.client_rid
            if route.prompt_token_ids is not None:
                out.prompt_token_ids = route.prompt_token_ids
                route.prompt_token_ids = None
            acts.to_clients.append((route.identity, out))

    def _on_stats_answer(self, acts: FrontendActions, msg: StatsAnswer) -> None:
        parts = split_part_id(msg.request_id)
        if parts is None:
            return
        eid, instance = parts
        fan = self.pending_stats.get(eid)
        if fan is not None and fan.answer(instance, dict(msg.stats)):
            self._reply_stats(acts, eid, fan)

    def _reply_stats(self, acts: FrontendActions, eid: str, fan: Fanout) -> None:
        del self.pending_stats[eid]
        stats = fan.merged()
        if not fan.reset:
            stats["frontend"] = self.counters()
            if self.nodes:
                stats["nodes"] = self.nodes
        acts.to_clients.append((fan.identity, StatsReply(fan.client_rid, stats)))

    def _on_instance_down(self, acts: FrontendActions, msg: InstanceDown) -> None:
        """An instance died: its requests that have streamed nothing go to another live
        instance under a new engine id; the others fail with the reason. Questions it
        has not answered are answered without it."""
        if not 0 <= msg.instance < self.num_instances:
            return
        log.error("instance %d is down: %s", msg.instance, msg.reason)
        if self.router.table[msg.instance].role == "prefill":
            # the decode instances fail what they were to pull from it at once
            for i, inst in enumerate(self.router.table.instances):
                if inst.role == "decode" and inst.alive:
                    acts.send(i, SourceDown(msg.instance, msg.reason))
        # past a drain's deadline nothing is sent anywhere again
        moved, ended = self.routes.instance_down(msg.instance, reroute=not self._drain_abort_sent)
        for instance, add in moved:
            acts.send(instance, add)
        for route in ended:
            self._release(route)
            self._end_transfer(acts, "", route, abort=False)
            reply = (
                OutputDelta(request_id=route.client_rid, finish_reason=FINISH_ABORT)
                if route.aborted
                else _engine_error(route, msg.reason)
            )
            acts.to_clients.append((route.identity, reply))
        for eid, fan in list(self.pending_stats.items()):
            if msg.instance in fan.waiting and fan.give_up(msg.instance, msg.reason):
                self._reply_stats(acts, eid, fan)

    def _end_transfer(
        self, acts: FrontendActions, eid: str, route: Route, abort: bool = True
    ) -> None:
        """A disaggregated request ended (finished, failed, its client gone): its KV still
        held by a prefill instance is freed there, and with `abort` a decode instance that
        may still run it is told (its finish may have come from the prefill side)."""
        if route.source is not None:
            instance, source_rid = route.source
            route.source = None
            acts.send(instance, ReleaseKV(source_rid))
        if abort and route.decoding:
            acts.send(route.instance, Abort(request_id=eid))

    def _on_hand_off(self, acts: FrontendActions, msg: HandOff) -> None:
        """A prefill instance computed a prompt and streamed its first token: the request
        goes to a decode instance, which pulls its KV; a request that is gone, or that
        no decode instance can take, frees its KV (and the latter fails)."""
        try:
            add = self.routes.hand_off(msg)
        except NoInstanceError as e:
            route = self.inflight.get(msg.request_id)
            acts.send(msg.instance, ReleaseKV(msg.request_id))
            if route is not None:
                self.routes.forget(msg.request_id, route)
                self._release(route)
                acts.to_clients.append((route.identity, _engine_error(route, str(e))))
            return
        if add is None:
            acts.send(msg.instance, ReleaseKV(msg.request_id))
            return
        acts.send(self.inflight[msg.request_id].instance, add)

    def _on_kv_done(self, acts: FrontendActions, msg: KVDone) -> None:
        """A decode instance has a request's KV (or gave up on it): the prefill instance
        frees its copy."""
        self.routes.kv_done(msg.request_id)
        acts.send(msg.source_instance, ReleaseKV(msg.source_request_id))

    def _on_engine_dead(self, acts: FrontendActions, reason: str) -> None:
        self.dead_reason = reason
        for route in self.inflight.values():
            acts.to_clients.append((route.identity, _engine_error(route, reason)))
        self.routes.clear()
        self.clients.clear()
        for fan in self.pending_stats.values():
            acts.to_clients.append((fan.identity, StatsReply(fan.client_rid, {"dead": reason})))
        self.pending_stats.clear()

    # ---- time ------------------------------------------------------------------------

    def heartbeats(self) -> list[ClientReply]:
        """One heartbeat per client with requests in flight."""
        now = self.clock()
        idents = {route.identity for route in self.inflight.values()}
        idents.update(fan.identity for fan in self.pending_stats.values())
        return [(ident, Heartbeat(time=now)) for ident in idents]

    def drain_tick(self) -> FrontendActions:
        """Past the drain deadline, aborts whatever is still in flight (once)."""
        acts = FrontendActions()
        if self.draining and not self._drain_abort_sent and self.clock() >= self.drain_deadline:
            self._drain_abort_sent = True
            for eid, route in self.inflight.items():
                acts.send(route.instance, Abort(request_id=eid))
        return acts

    @property
    def drained(self) -> bool:
        """Draining and nothing is in flight any more."""
        return self.draining and not self.inflight


def _engine_error(route: Route, reason: str) -> OutputDelta:
    """The final output of a request whose engine (or instance) failed."""
    return OutputDelta(
        request_id=route.client_rid,
        finish_reason=FINISH_ERROR,
        error=f"engine failed: {reason}",
        error_type=ERROR_ENGINE,
    )
