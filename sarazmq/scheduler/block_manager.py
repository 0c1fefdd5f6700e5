"""Paged KV-cache block accounting (ids only; the workers own the memory), with
automatic prefix caching.

Prefix caching (on unless `enable_caching=False`): once a block is full and its KV
computed, it gets a key (`prefix_cache.sha256_block_key`: parent key, token ids,
cache_salt) and is entered in a key -> block map. A later request whose leading full
blocks have the same keys shares those blocks (reference counts) instead of computing
them again. A block whose count drops to 0 keeps its contents and key: it is free
(counted in `num_free_blocks`) but evictable, and is reused for a hit until a new
allocation needs it. Allocation takes, in this order: free blocks without a key
(oldest freed first), then cached blocks least recently freed first, and among the
blocks one request freed at once the tail of its chain before the head. A block in use
is never evicted. A block is (re)keyed only as a whole; its old key is dropped the
moment it is handed out again.

Collisions cannot give wrong KV: a key only *finds* a candidate; `find_cached_blocks`
accepts it only if the block's recorded token ids and salt equal the request's and its
recorded parent is the block the previous hit returned, with the same allocation
generation (bumped every time a block is handed out fresh). By induction a hit chain is
token-for-token the request's own prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from sarazmq.scheduler.prefix_cache import ROOT_KEY, BlockHashFn, sha256_block_key
from sarazmq.scheduler.request import Request


class BlockAllocationError(RuntimeError):
    """An allocation or free that the pool cannot honour (a scheduler bug, not bad input)."""


#: A request's `cache_parent` once its chain met a colliding key: nothing more is keyed.
_BROKEN = (-1, -1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _CachedBlock:
    """What a keyed block holds: enough to verify a hit without trusting the key."""

    __slots__ = ("key", "parent", "salt", "token_ids")

    def __init__(
        self,
        key: bytes,
        parent: tuple[int, int] | None,
        token_ids: list[int],
        salt: str | None,
    ) -> None:
        self.key = key
        self.parent = parent  # (block id, generation) of the previous block; None for block 0
        self.token_ids = token_ids
        self.salt = salt


class BlockManager:
    """A fixed pool of `num_blocks` blocks of `block_size` token slots each.

    A request's `block_ids` is its block table: token position p lives in block
    `block_ids[p // block_size]`. A request only ever grows its table (`allocate`,
    `allocate_with_hits`) or gives all of it back (`free`).

    enable_caching: automatic prefix caching (see the module doc); off gives exactly the
        old free-list behaviour. hash_fn: the block key function (tests pass a colliding
        stub).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        *,
        enable_caching: bool = False,
        hash_fn: BlockHashFn = sha256_block_key,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self._num_blocks = num_blocks
        # free blocks without a key, handed out first (FIFO)
        self._free: deque[int] = deque(range(num_blocks))
        # free blocks with a key, in eviction order (first = next to go)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * num_blocks
        self._gen = [0] * num_blocks
        self._cached: list[_CachedBlock | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self.num_evictions = 0

    # ---- sizes ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request (with or without cached contents)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key (in use or evictable)."""
        return len(self._by_key)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_token_slots(self) -> int:
        """Tokens the whole pool can hold."""
        return self._num_blocks * self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def key_of(self, block_id: int) -> bytes | None:
        c = self._cached[block_id]
        return None if c is None else c.key

    def evictable_order(self) -> list[int]:
        """Cached free blocks, next to be evicted first (for tests and debugging)."""
        return list(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token positions."""
        return cdiv(num_tokens, self.block_size)

    # ---- plain allocation ----

    def can_allocate(self, num_tokens: int, watermark_blocks: int = 0) -> bool:
        """Whether a request with no blocks could get blocks for `num_tokens` positions
        and still leave `watermark_blocks` free."""
        if num_tokens < 0 or watermark_blocks < 0:
            raise ValueError(
                f"num_tokens={num_tokens}, watermark_blocks={watermark_blocks} must be >= 0"
            )
        return self.blocks_for(num_tokens) + watermark_blocks <= self.num_free_blocks

    def num_new_blocks_needed(self, request: Request, upto_num_tokens: int) -> int:
        """Blocks `request` lacks to cover positions [0, upto_num_tokens)."""
        return max(0, self.blocks_for(upto_num_tokens) - len(request.block_ids))

    def can_grow(self, request: Request, upto_num_tokens: int) -> bool:
        """Whether `allocate(request, upto_num_tokens)` would succeed."""
        return self.num_new_blocks_needed(request, upto_num_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, upto_num_tokens: int) -> list[int]:
        """Grows `request.block_ids` to cover positions [0, upto_num_tokens).

        Returns the newly allocated block ids (possibly none). Raises
        BlockAllocationError when the pool has too few free blocks (nothing changes then).
        """
        if upto_num_tokens < 0:
            raise ValueError(f"upto_num_tokens={upto_num_tokens} must be >= 0")
        need = self.num_new_blocks_needed(request, upto_num_tokens)
        if need > self.num_free_blocks:
            raise BlockAllocationError(
                f"request {request.request_id!r} needs {need} more blocks for "
                f"{upto_num_tokens} tokens but only {self.num_free_blocks} are free"
            )
        new = [self._take_free() for _ in range(need)]
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> int:
        """Drops `request`'s reference to each of its blocks; returns how many.

        A block nobody uses any more becomes free; a keyed one stays cached (evictable),
        the request's tail entering the eviction order before its head.
        """
        for b in request.block_ids:
            if self._ref[b] <= 0:
                raise BlockAllocationError(
                    f"block {b} of request {request.request_id!r} is not allocated (double free?)"
                )
        unkeyed: list[int] = []
        for b in reversed(request.block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._cached[b] is not None:
                    self._evictable[b] = None
                else:
                    unkeyed.append(b)
        unkeyed.reverse()
        self._free.extend(unkeyed)
        n = len(request.block_ids)
        request.block_ids = []
        request.num_keyed_blocks = 0
        request.cache_parent = None
        return n

    # ---- prefix caching ----

    def block_keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The keys of `request`'s first `num_blocks` full blocks (computed once and kept
        on the request: its tokens only ever grow)."""
        keys = request.block_keys
        bs = self.block_size
        salt = request.params.cache_salt
        while len(keys) < num_blocks:
            i = len(keys)
            parent = keys[-1] if keys else ROOT_KEY
            keys.append(self.hash_fn(parent, request.token_slice(i * bs, (i + 1) * bs), salt))
        return keys[:num_blocks]

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The longest verified run of cached blocks holding `request`'s first tokens:
        contiguous from block 0, whole blocks only, at most num_tokens - 1 tokens (the
        last token is always computed, to sample from). [] when caching is off."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return []
        salt = request.params.cache_salt
        hits: list[int] = []
        parent: tuple[int, int] | None = None
        for i, key in enumerate(self.block_keys(request, max_blocks)):
            b = self._by_key.get(key)
            if b is None:
                break
            c = self._cached[b]
            assert c is not None
            if (
                c.parent != parent
                or c.salt != salt
                or c.token_ids != request.token_slice(i * bs, (i + 1) * bs)
            ):
                break  # a key collision: never trust the key alone
            hits.append(b)
            parent = (b, self._gen[b])
        return hits

    def num_blocks_to_admit(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks an admission of `num_tokens` positions with these hit blocks
        takes: the missing blocks plus the hits nobody uses now (they leave the free
        pool)."""
        return self.blocks_for(num_tokens) - len(hits) + sum(1 for b in hits if self._ref[b] == 0)

    def can_allocate_with_hits(
        self, num_tokens: int, hits: list[int], watermark_blocks: int = 0
    ) -> bool:
        """`can_allocate` for an admission that reuses `hits`."""
        return self.num_blocks_to_admit(num_tokens, hits) + watermark_blocks <= self.num_free_blocks

    def allocate_with_hits(self, request: Request, hits: list[int], upto_num_tokens: int) -> None:
        """Gives a request with no blocks the hit blocks (shared) and fresh blocks for the
        rest of [0, upto_num_tokens). Raises BlockAllocationError, changing nothing,
        when the pool is too small."""
        if request.block_ids:
            raise BlockAllocationError(f"request {request.request_id!r} already has blocks")
        need = self.num_blocks_to_admit(upto_num_tokens, hits)
        if need > self.num_free_blocks:
            raise BlockAllocationError(
                f"request {request.request_id!r} needs {need} blocks for {upto_num_tokens} "
                f"tokens ({len(hits)} cached) but only {self.num_free_blocks} are free"
            )
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        request.block_ids = list(hits)
        request.num_keyed_blocks = len(hits)
        request.cache_parent = (hits[-1], self._gen[hits[-1]]) if hits else None
        self.allocate(request, upto_num_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Keys every block of `request` that is full and computed and has no key yet
        (called after a step's KV is written).

        A block whose key another block already holds with the same verified contents
        stays unkeyed (that copy serves hits) and the chain continues from that copy;
        if the other copy does not verify (a collision), keying stops for this request.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        # asynchronous scheduling counts positions scheduled whose tokens are still to
        # come (`Request.num_pending_samples`): only known tokens can be keyed
        computed = min(request.num_computed_tokens, request.num_tokens)
        full = min(computed // bs, len(request.block_ids))
        start = request.num_keyed_blocks
        if full <= start:
            return
        keys = self.block_keys(request, full)
        salt = request.params.cache_salt
        parent = request.cache_parent
        for i in range(start, full):
            if parent == _BROKEN:
                break
            b = request.block_ids[i]
            tokens = request.token_slice(i * bs, (i + 1) * bs)
            other = self._by_key.get(keys[i])
            if other is None:
                self._cached[b] = _CachedBlock(keys[i], parent, tokens, salt)
                self._by_key[keys[i]] = b
                parent = (b, self._gen[b])
            else:
                c = self._cached[other]
                assert c is not None
                if c.parent == parent and c.salt == salt and c.token_ids == tokens:
                    parent = (other, self._gen[other])
                else:
                    parent = _BROKEN
        request.cache_parent = parent
        request.num_keyed_blocks = full

    def reset_cache(self) -> tuple[bool, str]:
        """Forgets every key. Refused (False, why) while any block is in use: a running
        request's blocks would otherwise lose their keys mid-flight."""
        used = self.num_used_blocks
        if used:
            return False, (
                f"{used} KV blocks are in use by running requests; "
                "reset_prefix_cache needs an idle engine"
            )
        for b in self._evictable:
            self._drop_key(b)
        self._free.extend(self._evictable)
        self._evictable.clear()
        return True, ""

    # ---- internals ----

    def _drop_key(self, b: int) -> None:
        c = self._cached[b]
        if c is not None:
            if self._by_key.get(c.key) == b:
                del self._by_key[c.key]
            self._cached[b] = None

    def _take_free(self) -> int:
        """One block for fresh contents: unkeyed first, else evict the LRU cached one."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            self._drop_key(b)
            self.num_evictions += 1
        self._gen[b] += 1
        self._ref[b] = 1
        return b
