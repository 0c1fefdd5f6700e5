"""Paged KV-cache block accounting (ids only; the workers own the memory)."""

from __future__ import annotations

from collections import deque

from sarazmq.scheduler.request import Request


class BlockAllocationError(RuntimeError):
    """An allocation or free that the pool cannot honour (a scheduler bug, not bad input)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """A fixed pool of `num_blocks` blocks of `block_size` token slots each.

    A request's `block_ids` is its block table: token position p lives in block
    `block_ids[p // block_size]`. Blocks are handed out from a free list; a request
    only ever grows its table (`allocate`) or gives all of it back (`free`).
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_token_slots(self) -> int:
        """Tokens the whole pool can hold."""
        return self._num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token positions."""
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int, watermark_blocks: int = 0) -> bool:
        """Whether a request with no blocks could get blocks for `num_tokens` positions
        and still leave `watermark_blocks` free."""
        if num_tokens < 0 or watermark_blocks < 0:
            raise ValueError(
                f"num_tokens={num_tokens}, watermark_blocks={watermark_blocks} must be >= 0"
            )
        return self.blocks_for(num_tokens) + watermark_blocks <= len(self._free)

    def num_new_blocks_needed(self, request: Request, upto_num_tokens: int) -> int:
        """Blocks `request` lacks to cover positions [0, upto_num_tokens)."""
        return max(0, self.blocks_for(upto_num_tokens) - len(request.block_ids))

    def can_grow(self, request: Request, upto_num_tokens: int) -> bool:
        """Whether `allocate(request, upto_num_tokens)` would succeed."""
        return self.num_new_blocks_needed(request, upto_num_tokens) <= len(self._free)

    def allocate(self, request: Request, upto_num_tokens: int) -> list[int]:
        """Grows `request.block_ids` to cover positions [0, upto_num_tokens).

        Returns the newly allocated block ids (possibly none). Raises
        BlockAllocationError when the pool has too few free blocks (nothing is
        allocated then).
        """
        if upto_num_tokens < 0:
            raise ValueError(f"upto_num_tokens={upto_num_tokens} must be >= 0")
        need = self.num_new_blocks_needed(request, upto_num_tokens)
        if need > len(self._free):
            raise BlockAllocationError(
                f"request {request.request_id!r} needs {need} more blocks for "
                f"{upto_num_tokens} tokens but only {len(self._free)} are free"
            )
        new = [self._free.popleft() for _ in range(need)]
        self._used.update(new)
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> int:
        """Returns all of `request`'s blocks to the pool; returns how many."""
        for b in request.block_ids:
            if b not in self._used:
                raise BlockAllocationError(
                    f"block {b} of request {request.request_id!r} is not allocated (double free?)"
                )
        for b in request.block_ids:
            self._used.remove(b)
            self._free.append(b)
        n = len(request.block_ids)
        request.block_ids = []
        return n
