"""The engine requests in flight: where each one's outputs go and which instance runs it.

Every client request becomes an engine request whose id is unique in the deployment
(`engine_id`: the client's identity and its request id). A request is routed to an
engine instance once (`Routes.route`); with several instances, one that dies before
streaming anything is sent to another under a new engine id (`Routes.reroute`: the base
id, REROUTE_SEP and the attempt number), so late outputs of the dead instance for the old
id find no route and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sarazmq.protocol.engine import AddPrefilled, AddRequest, HandOff
from sarazmq.router import (
    InstanceTable,
    NoInstanceError,
    Router,
    RouterConfig,
    prompt_block_keys,
)

#: separates a client request's engine id from its attempt number when it was sent again
#: to another instance (a control character: the frontend refuses client ids with any)
REROUTE_SEP = "\x1f"


def engine_id(identity: bytes, client_rid: str) -> str:
    return f"{identity.hex()}/{client_rid}"


@dataclass
class Route:
    """Where one engine request's outputs go, and where it runs.

    prompt_token_ids: attached to the first output, then dropped (the client needs them
    once). add: the request as sent, kept (several instances only) until its first
    output, so that it can be sent to another instance if its own dies before streaming
    anything. attempt: how many times it was sent to another instance."""

    identity: bytes
    client_rid: str
    prompt_token_ids: list[int] | None
    instance: int = 0
    add: AddRequest | None = None
    attempt: int = 0
    # a disaggregated deployment: handed off to a decode instance (`instance`), and where
    # its prompt's KV still is until the decode instance has it (prefill instance and the
    # id it was exported as there)
    decoding: bool = False
    source: tuple[int, str] | None = None
    # the client asked to abort it: never sent anywhere again
    aborted: bool = False

    @property
    def base_id(self) -> str:
        return engine_id(self.identity, self.client_rid)


class Routes:
    """The in-flight requests by engine id, and the router that places new ones."""

    def __init__(self, router: Router | None = None) -> None:
        # one instance unless told otherwise (a deployment with --dp gives its router)
        self.router = router or Router(
            RouterConfig(policy="round-robin"), InstanceTable([1], [0]), block_size=16
        )
        self.num_instances = len(self.router.table)
        self._hash_prompts = self.num_instances > 1 and self.router.config.policy == "cache-aware"
        # new requests go to prefill instances when there are any (disaggregated)
        self.entry_role = (
            "prefill" if any(i.role == "prefill" for i in self.router.table.instances) else "mixed"
        )
        self.inflight: dict[str, Route] = {}
        # base engine id -> current engine id, for the requests sent again elsewhere
        self._rerouted: dict[str, str] = {}
        self.num_rerouted = 0

    def __len__(self) -> int:
        return len(self.inflight)

    def current_id(self, base_id: str) -> str:
        """The engine id a client request runs under now."""
        return self._rerouted.get(base_id, base_id)

    def has(self, base_id: str) -> bool:
        return base_id in self.inflight or base_id in self._rerouted

    def live_instances(self) -> list[int]:
        return [i for i in range(self.num_instances) if self.router.table[i].alive]

    def route(self, add: AddRequest) -> int:
        """The instance for a request (the router's choice; NoInstanceError when none is
        up). Only a cache-aware router over several instances needs the prompt's block
        keys."""
        if self.num_instances == 1:
            if not self.router.table[0].alive:
                raise NoInstanceError("its instance is restarting")
            return 0
        keys = (
            prompt_block_keys(add.prompt_token_ids, self.router.block_size, add.params.cache_salt)
            if self._hash_prompts
            else []
        )
        return self.router.route(keys, len(add.prompt_token_ids), role=self.entry_role)

    def add(self, add: AddRequest, identity: bytes, client_rid: str, instance: int) -> None:
        """`add` was routed to `instance`: its outputs go to (identity, client_rid)."""
        keep = add if self.num_instances > 1 else None
        self.inflight[add.request_id] = Route(
            identity, client_rid, add.prompt_token_ids, instance, keep
        )

    def forget(self, eid: str, route: Route) -> None:
        """Drops an in-flight request (finished, failed or its client gone)."""
        self.inflight.pop(eid, None)
        if route.attempt:
            self._rerouted.pop(route.base_id, None)

    def reroute(self, eid: str, route: Route) -> AddRequest:
        """Sends a request that has streamed nothing (route.add is set) to another live
        instance under a new engine id; returns the request to send (to route.instance).
        NoInstanceError when no instance is up."""
        if route.add is None:
            raise ValueError(f"{eid!r} has streamed output: it cannot move")
        attempt = route.attempt + 1
        new_id = f"{route.base_id}{REROUTE_SEP}{attempt}"
        moved = msgspec.structs.replace(route.add, request_id=new_id)
        instance = self.route(moved)
        self.inflight.pop(eid, None)
        route.instance, route.attempt, route.add = instance, attempt, moved
        self.inflight[new_id] = route
        self._rerouted[route.base_id] = new_id
        self.num_rerouted += 1
        return moved

    def instance_down(
        self, instance: int, reroute: bool = True
    ) -> tuple[list[tuple[int, AddRequest]], list[Route]]:
        """`instance` died: the router stops choosing it; its requests that have streamed
        nothing (and were not aborted by their client) move to a live instance
        (`reroute`; not when `reroute` is False, e.g. past a drain's deadline), the others
        are forgotten. Returns the moved requests (instance, request to send) and the
        routes that ended (`Route.aborted` tells the client's aborts from failures)."""
        self.router.mark_down(instance)
        moved: list[tuple[int, AddRequest]] = []
        failed: list[Route] = []
        for eid, route in list(self.inflight.items()):
            if route.instance != instance:
                continue
            if route.add is not None and reroute and not route.aborted:
                try:
                    add = self.reroute(eid, route)
                except NoInstanceError:
                    pass
                else:
                    moved.append((route.instance, add))
                    continue
            self.forget(eid, route)
            failed.append(route)
        return moved, failed

    def hand_off(self, msg: HandOff) -> AddPrefilled | None:
        """A prefill instance handed a request off: the decode instance it goes to now
        (the router's least-loaded decode instance; NoInstanceError when none is up) and
        the message for it; None when the request is gone (its KV is then to be freed)."""
        route = self.inflight.get(msg.request_id)
        if route is None:
            return None
        instance = self.router.route([], 0, role="decode")
        route.instance, route.decoding, route.add = instance, True, None
        route.source = (msg.instance, msg.request_id)
        return AddPrefilled(
            msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time,
            msg.first_token, msg.first_token_time, msg.first_scheduled_time,
            msg.instance, msg.request_id, msg.block_ids,
        )  # fmt: skip

    def kv_done(self, request_id: str) -> None:
        """The decode instance has the request's KV (or gave up on it)."""
        route = self.inflight.get(request_id)
        if route is not None:
            route.source = None

    def clear(self) -> None:
        self.inflight.clear()
        self._rerouted.clear()
