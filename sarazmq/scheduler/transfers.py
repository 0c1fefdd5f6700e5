"""The scheduler's side of a disaggregated deployment: parking, handing off, pulling KV.

Prefill instance (`KVParking`): a request whose first token was just sampled (and did
not finish it) leaves the running requests but keeps its blocks: it is *parked*, its KV
exported to the instance's workers (`KVExport`), and handed off (`take_handoffs`: the
service tells the frontend, which picks a decode instance). Its blocks are freed when
the frontend says the KV was pulled or is no longer needed (`release`), as on an abort.

Decode instance (`KVPulls`): a handed-off request arrives with its first token and where
its KV is (`Scheduler.add_prefilled_request(..., source=...)`). It queues until the pool
has blocks for its prompt and first token; then they are allocated and its workers pull
the KV into them (`KVPull`, one per request, to every worker); when every rank has
reported (`KVPulled`), the request joins the waiting queue with its blocks and prompt
counted as computed, and the frontend is told the source may free its copy. A pull that
fails finishes the request with an error. A request aborted while its pull runs keeps its
blocks until every rank has reported: a late write must not land in reused blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sarazmq.protocol.worker import KVPull
from sarazmq.scheduler.block_manager import BlockManager
from sarazmq.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class KVSource:
    """Where a handed-off request's KV is: the prefill instance, the id it was exported
    as there, and its blocks there."""

    instance: int
    request_id: str
    block_ids: list[int]


class KVParking:
    """A prefill instance's parked requests (see the module docstring)."""

    def __init__(self) -> None:
        self.parked: dict[str, Request] = {}
        self._handoffs: list[Request] = []

    def park(self, req: Request) -> None:
        req.status = RequestStatus.PARKED
        self.parked[req.request_id] = req
        self._handoffs.append(req)

    def take_handoffs(self) -> list[Request]:
        """The requests parked since the last call (to hand off, oldest first)."""
        out, self._handoffs = self._handoffs, []
        return out

    def pop(self, request_id: str) -> Request | None:
        """The parked request, no longer parked (None when it is not)."""
        req = self.parked.pop(request_id, None)
        if req is not None and req in self._handoffs:
            self._handoffs.remove(req)
        return req


@dataclass
class _Pull:
    req: Request
    source: KVSource
    waiting_for: set[int]
    errors: list[str] = field(default_factory=list)
    cancelled: bool = False
    nbytes: int = 0
    seconds: float = 0.0


class KVPulls:
    """A decode instance's requests between arriving and having their KV (see the
    module docstring). `world`: the ranks that pull (each reports once per pull)."""

    def __init__(self, blocks: BlockManager, world: int) -> None:
        self.blocks = blocks
        self.world = world
        self.queue: deque[tuple[Request, KVSource]] = deque()
        self.pulling: dict[int, _Pull] = {}
        self._to_send: list[KVPull] = []
        # the pulls done so far: count, bytes (every rank's), seconds (the slowest rank's)
        self.num_done = 0
        self.done_bytes = 0
        self.done_seconds = 0.0

    def __len__(self) -> int:
        return len(self.queue) + len(self.pulling)

    def add(self, req: Request, source: KVSource) -> None:
        req.status = RequestStatus.TRANSFERRING
        self.queue.append((req, source))

    def start(self, watermark_blocks: int) -> None:
        """Allocates blocks to the queued requests that fit, oldest first (a request that
        does not fit waits, and so do those behind it), and queues their pulls."""
        while self.queue:
            req, source = self.queue[0]
            total = req.num_tokens  # prompt + first token
            if not self.blocks.can_allocate_with_hits(total, [], watermark_blocks):
                return
            self.queue.popleft()
            self.blocks.allocate_with_hits(req, [], total)
            self.pulling[req.seq_id] = _Pull(req, source, set(range(self.world)))
            n = len(source.block_ids)
            self._to_send.append(
                KVPull(
                    seq_id=req.seq_id,
                    source_instance=source.instance,
                    source_request_id=source.request_id,
                    source_block_ids=source.block_ids,
                    block_ids=req.block_ids[:n],
                )
            )

    def take_pulls(self) -> list[KVPull]:
        out, self._to_send = self._to_send, []
        return out

    def pulled(
        self, seq_id: int, rank: int, error: str, nbytes: int = 0, seconds: float = 0.0
    ) -> tuple[Request, KVSource, str] | None:
        """One rank's report. When every rank has reported: (request, source, error of
        the pull: "" when it is in place), and the request's blocks are its own; a
        cancelled pull's blocks are freed then. None while ranks are still pulling (or
        for a pull it does not know)."""
        pull = self.pulling.get(seq_id)
        if pull is None or rank not in pull.waiting_for:
            return None
        pull.waiting_for.discard(rank)
        pull.nbytes += nbytes
        pull.seconds = max(pull.seconds, seconds)
        if error:
            pull.errors.append(f"rank {rank}: {error}")
        if pull.waiting_for:
            return None
        del self.pulling[seq_id]
        if not pull.errors and not pull.cancelled:
            self.num_done += 1
            self.done_bytes += pull.nbytes
            self.done_seconds += pull.seconds
        if pull.cancelled:  # finished by the scheduler already: only its blocks were left
            self.blocks.free(pull.req)
            return pull.req, pull.source, "cancelled"
        return pull.req, pull.source, "; ".join(pull.errors)

    def from_source(self, instance: int) -> list[Request]:
        """The requests (queued or pulling, not cancelled) whose KV comes from `instance`."""
        out = [req for req, source in self.queue if source.instance == instance]
        out += [
            p.req
            for p in self.pulling.values()
            if p.source.instance == instance and not p.cancelled
        ]
        return out

    def cancel(self, request_id: str) -> bool | None:
        """Drops a request being transferred (aborted, or its client gone). Returns None
        when it is not here; False when it was queued (it holds no blocks); True when its
        pull runs: its blocks stay allocated until every rank has reported (`pulled`
        frees them then)."""
        for i, (req, _) in enumerate(self.queue):
            if req.request_id == request_id:
                del self.queue[i]
                return False
        for pull in self.pulling.values():
            if pull.req.request_id == request_id:
                pull.cancelled = True
                return True
        return None
