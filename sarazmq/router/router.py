"""Routing a request to an engine instance: round-robin, least-load and cache-aware.

The `Router` is socket-free: the frontend asks it for an instance per request (and
tells it about load reports, deaths and restarts); the fleet simulator uses the same
class with loads it reports after every simulated iteration.

- `round-robin`: the live instances in turn.
- `least-load`: the instance where the request's prefill would start soonest
  (`InstanceState.rank`: KV pool not full, fewest prefill iterations queued, fewest
  running decodes).
- `cache-aware`: the same cost, with the request's own prefill reduced by the prompt
  blocks the instance was recently sent (`PrefixIndex`: SGLang's cache-aware router
  keeps such a tree of what it routed), so a conversation goes back to the instance
  holding its history while that is not much busier than the others. A match under
  `cache_threshold` of the prompt's blocks (a shared system prompt) does not steer: the
  few instances holding it would take every request while others idle (SGLang's router
  has the same threshold). The load bound:
  only instances whose wait is within `balance_abs` iterations (plus `balance_rel` of
  the least loaded one's) of the least loaded are candidates, so a hot prefix spreads
  to more instances instead of queueing on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sarazmq.config import ROUTER_POLICIES, EngineConfig
from sarazmq.router.prefix_index import PrefixIndex
from sarazmq.router.table import InstanceTable
from sarazmq.scheduler import ROOT_KEY, sha256_block_key

#: the longest prompt prefix the router hashes and matches (blocks); beyond it a prompt is
#: long enough that its first 16k tokens decide where its cache is
MAX_ROUTE_BLOCKS = 1024


class NoInstanceError(RuntimeError):
    """No live instance can take the request."""


@dataclass(frozen=True)
class RouterConfig:
    """policy: one of ROUTER_POLICIES. balance_abs / balance_rel: the cache-aware load
    bound (see the module docstring), in prefill iterations. cache_threshold: the share
    of a prompt's blocks an instance must hold for cache-aware to steer by it."""

    policy: str = "cache-aware"
    balance_abs: float = 4.0
    balance_rel: float = 0.5
    cache_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router {self.policy!r}; choose one of {ROUTER_POLICIES}")
        if not (self.balance_abs >= 0 and self.balance_rel >= 0):
            raise ValueError("balance_abs and balance_rel must be >= 0")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache_threshold must be in [0, 1]")


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[bytes]:
    """The chained keys of the prompt's blocks the prefix cache could serve (the cache's
    own keys), at most MAX_ROUTE_BLOCKS of them."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    # the engine reuses at most (n - 1) // block_size blocks: the last token is computed
    full = min(max(0, len(token_ids) - 1) // block_size, MAX_ROUTE_BLOCKS)
    for b in range(full):
        parent = sha256_block_key(parent, token_ids[b * block_size : (b + 1) * block_size], salt)
        keys.append(parent)
    return keys


class Router:
    """Picks an instance per request and keeps its view of the instances up to date."""

    def __init__(self, config: RouterConfig, table: InstanceTable, block_size: int) -> None:
        self.config = config
        self.table = table
        self.block_size = block_size
        self.index = PrefixIndex([inst.kv_total_blocks for inst in table.instances])
        self._next = 0  # round-robin position (and the tie-breaker's rotation)
        # routed requests with at least one cached-prefix block matched (cache-aware)
        self.num_routed = 0
        self.num_matched = 0
        self.matched_blocks = 0

    def route(self, keys: Sequence[bytes], prompt_tokens: int, role: str = "mixed") -> int:
        """The instance for a request with these prompt block keys (`prompt_block_keys`)
        and `prompt_tokens` tokens, among the live ones of `role`; records the choice.
        NoInstanceError when none is alive."""
        mask = self.table.alive_mask(role)
        if not mask:
            raise NoInstanceError(f"no {role} instance is up")
        candidates = _bits(mask)
        policy = self.config.policy
        matched = 0
        if policy == "round-robin":
            choice = candidates[self._next % len(candidates)]
            self._next += 1
        elif policy == "least-load":
            choice = self._least(candidates, {i: prompt_tokens for i in candidates})
        else:
            choice, matched = self._cache_aware(candidates, keys, prompt_tokens)
        self.num_routed += 1
        if matched:
            self.num_matched += 1
            self.matched_blocks += matched
        self.table.on_sent(choice, max(0, prompt_tokens - matched * self.block_size))
        self.index.insert(choice, keys)
        return choice

    def _least(self, candidates: list[int], own: dict[int, int]) -> int:
        """The best-ranked candidate; ties go round in turn (not always to the lowest
        index, which would load instance 0 first whenever all are idle)."""
        start = self._next % len(candidates)
        self._next += 1
        order = candidates[start:] + candidates[:start]
        return min(order, key=lambda i: self.table[i].rank(own[i]))

    def _cache_aware(
        self, candidates: list[int], keys: Sequence[bytes], prompt_tokens: int
    ) -> tuple[int, int]:
        waits = {i: self.table[i].prefill_iterations() for i in candidates}
        lowest = min(waits.values())
        bound = lowest * (1.0 + self.config.balance_rel) + self.config.balance_abs
        eligible = [i for i in candidates if waits[i] <= bound]
        mask = 0
        for i in eligible:
            mask |= 1 << i
        hits = self.index.match_lengths(keys, mask) if keys else {}
        # a short match (a shared system prompt) is not worth steering for: every
        # request would pile onto the instances that happen to hold it
        floor = self.config.cache_threshold * len(keys)
        hits = {i: n for i, n in hits.items() if n and n >= floor}
        own = {i: max(0, prompt_tokens - hits.get(i, 0) * self.block_size) for i in eligible}
        choice = self._least(eligible, own)
        return choice, hits.get(choice, 0)

    def mark_down(self, instance: int) -> None:
        self.table.mark_down(instance)
        self.index.clear(instance)

    def mark_up(self, instance: int) -> None:
        self.table.mark_up(instance)
        self.index.clear(instance)

    def counters(self) -> dict[str, object]:
        return {
            "policy": self.config.policy,
            "num_routed": self.num_routed,
            "num_prefix_matched": self.num_matched,
            "matched_blocks": self.matched_blocks,
            "instances": self.table.loads(),
        }


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def build_router(config: EngineConfig) -> Router:
    """The router of an engine config: its instances (replicas, or prefill and decode
    instances) with their token budget and KV pool (resolved), spread by
    `config.router`."""
    n = config.num_instances
    roles = [config.instance_role(i) for i in range(n)]
    table = InstanceTable([config.scheduler.chunk_size] * n, [config.cache.num_blocks] * n, roles)
    return Router(RouterConfig(policy=routing_policy(config)), table, config.cache.block_size)


def routing_policy(config: EngineConfig) -> str:
    """The router's policy for a config: its own, but least-load for cache-aware without a
    prefix cache (nothing is reused there: matching prompts would only skew the load)."""
    if config.router == "cache-aware" and not config.cache.enable_prefix_caching:
        return "least-load"
    return config.router
