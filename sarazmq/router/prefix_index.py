"""Which instance was recently sent which prompt prefix: the router's view of the caches.

The router cannot see inside the instances' prefix caches, so, as SGLang's cache-aware
router does with its approximate radix tree, it remembers what it sent where: for each
instance, the chained block keys of the prompts routed to it, bounded by that instance's
KV pool and forgotten least recently routed first (the order in which the instance's own
prefix cache evicts). Flattened: block key -> bitmask of the instances holding it, which
makes a longest-prefix match over all instances one walk down the request's keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Block keys per instance (see the module docstring).

    capacity: per instance, how many block keys it can hold (its KV pool's blocks).
    """

    def __init__(self, capacity: Sequence[int]) -> None:
        if any(c < 0 for c in capacity):
            raise ValueError(f"capacities must be >= 0, got {list(capacity)}")
        self.capacity = list(capacity)
        # per instance: its keys, least recently routed first
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in capacity]
        # key -> bitmask of the instances holding it
        self._holders: dict[bytes, int] = {}

    @property
    def num_instances(self) -> int:
        return len(self.capacity)

    def size(self, instance: int) -> int:
        """Block keys remembered for `instance`."""
        return len(self._lru[instance])

    def match_lengths(self, keys: Sequence[bytes], candidates: int) -> dict[int, int]:
        """Per instance of the `candidates` bitmask that holds at least the first key: how
        many leading keys of `keys` it holds (its longest prefix match, in blocks)."""
        out: dict[int, int] = {}
        mask = candidates
        depth = 0
        holders = self._holders
        for key in keys:
            held = holders.get(key, 0) & mask
            dropped = mask & ~held
            if depth and dropped:
                _assign(out, dropped, depth)
            mask = held
            if not mask:
                return out
            depth += 1
        if depth:
            _assign(out, mask, depth)
        return out

    def insert(self, instance: int, keys: Sequence[bytes]) -> None:
        """`keys` were just routed to `instance` (most recently used now); evicts its least
        recently routed keys beyond its capacity."""
        lru = self._lru[instance]
        bit = 1 << instance
        holders = self._holders
        # the tail first: a prompt's head ends most recently used, so eviction takes a
        # chain from its end (as the engine's own cache frees a request's last blocks
        # first) and what is left stays matchable from the head
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders[key] = holders.get(key, 0) | bit
        while len(lru) > self.capacity[instance]:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def clear(self, instance: int) -> None:
        """Forgets everything of `instance` (it restarted: its cache is empty)."""
        bit = 1 << instance
        for key in self._lru[instance]:
            self._drop(key, bit)
        self._lru[instance].clear()

    def _drop(self, key: bytes, bit: int) -> None:
        left = self._holders[key] & ~bit
        if left:
            self._holders[key] = left
        else:
            del self._holders[key]


def _assign(out: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = depth
        mask ^= low
