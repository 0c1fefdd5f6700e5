"""Prefix-cache keys and counters (the block manager does the caching itself).

A full block's key chains its parent's key, its own token ids and the request's extra
keys (its `cache_salt`):

    key(block i) = SHA-256(key(block i-1) || msgpack([token ids of block i, cache_salt]))

with key(block -1) = 32 zero bytes. SHA-256 because its collisions are not feasible to
produce on purpose; Python's `hash()` is 64 bits, salted per process and easy to collide.
The key is only an index, though: a hit is accepted only after the block manager has
compared the cached block's own token ids, salt and parent block (see
`BlockManager.find_cached_blocks`), so even a hash that always collides can cost hits,
never correctness.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

#: The parent key of a sequence's first block.
ROOT_KEY = bytes(32)

#: (parent key, the block's token ids, cache_salt) -> key
BlockHashFn = Callable[[bytes, Sequence[int], "str | None"], bytes]

_encode = msgspec.msgpack.Encoder().encode


def sha256_block_key(parent: bytes, token_ids: Sequence[int], salt: str | None) -> bytes:
    """The default chained block key (32 bytes)."""
    h = hashlib.sha256(parent)
    h.update(_encode((list(token_ids), salt)))
    return h.digest()


class PrefixCacheCounters(msgspec.Struct, array_like=True, omit_defaults=True):
    """Hit counts in tokens, counted once per admission of a request.

    queries / hits: prompt tokens looked up / found cached at a request's first
    admission; preempted_queries / preempted_hits: the same for re-admissions after a
    recompute preemption (prompt + outputs so far), kept apart so that a preemption
    storm cannot inflate the hit rate of real traffic.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_cached: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_cached
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
