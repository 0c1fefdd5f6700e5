"""Moving a request's KV blocks between instances (a disaggregated deployment).

A prefill instance's worker exports the KV of a handed-off request (`KVExporter`: the
scheduler registers it, `KVExport`, and releases it, `KVRelease`); a decode instance's
worker pulls it into blocks of its own (`KVImporter`), each rank from the same rank of the
source instance (same tp x pp: the same heads and layers). On the wire, over ZeroMQ:

    request   KVRead(request_id, block_ids)                       decode -> prefill
    reply     KVBlocksHeader, then the K and V rows of each layer   prefill -> decode
              as raw frames (zero-copy from the cache tensors)

The header says what the frames hold (request, blocks, block size, layers, KV heads, row
width, dtype); the receiver checks every field against its own cache and every frame's
length before it writes anything, so a malformed or truncated reply, or one for another
request, is an error that names the problem and changes nothing. A read of a request the
exporter does not hold (never registered within `register_wait_s`, or released: a second
pull of the same KV) is answered with an error. torch.distributed (NCCL) between GPU
workers is not used yet: GPU tensors go through host memory.

`pack_blocks` / `unpack_blocks` are the socket-free core the tests drive.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import torch
import zmq

log = logging.getLogger("sarazmq.kv_transfer")

#: how long an exporter waits for a request it was asked for to be registered: the read
#: can arrive before the worker's main loop has taken the scheduler's KVExport
REGISTER_WAIT_S = 30.0
#: how long an importer waits for a reply (a source that died is reported sooner by the
#: frontend: `SourceDown`)
READ_TIMEOUT_S = 10.0

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [blocks, bs, H, row]


class KVRead(msgspec.Struct, array_like=True, tag="kv_read"):
    request_id: str
    block_ids: list[int]


class KVBlocksHeader(msgspec.Struct, array_like=True, omit_defaults=True, tag="kv_blocks"):
    """What the frames after it hold: per layer K then V, each [num_blocks, block_size,
    num_kv_heads, row] of `dtype`; error: why there are none."""

    request_id: str
    error: str = ""
    num_blocks: int = 0
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    row: int = 0
    dtype: str = ""


class KVTransferError(RuntimeError):
    """A KV transfer failed; the message names why."""


def _geometry(caches: KVCaches) -> tuple[int, int, int, str]:
    k = caches[0][0]
    return k.shape[1], k.shape[2], k.shape[3], str(k.dtype).removeprefix("torch.")


def pack_blocks(
    caches: KVCaches, request_id: str, block_ids: Sequence[int]
) -> tuple[KVBlocksHeader, list[memoryview]]:
    """The header and the raw frames of `block_ids`' K and V rows in every layer."""
    if not caches:
        raise KVTransferError("no KV cache to read")
    num_blocks = caches[0][0].shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad or not block_ids:
        raise KVTransferError(f"block ids {bad[:5] or '[]'} are not in [0, {num_blocks})")
    block_size, heads, row, dtype = _geometry(caches)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0][0].device)
    frames: list[memoryview] = []
    for k, v in caches:
        for t in (k, v):
            rows = t.index_select(0, index).cpu().contiguous()  # [n, bs, H, row]
            frames.append(memoryview(rows.view(torch.uint8).numpy()).cast("B"))
    header = KVBlocksHeader(
        request_id, "", len(block_ids), block_size, len(caches), heads, row, dtype
    )
    return header, frames


def unpack_blocks(
    caches: KVCaches,
    request_id: str,
    block_ids: Sequence[int],
    header: KVBlocksHeader,
    frames: Sequence[bytes | memoryview],
) -> None:
    """Writes a reply's rows into `block_ids` of `caches`, after checking that it is the
    reply for `request_id` and fits this cache exactly (KVTransferError naming what does
    not, with nothing written)."""
    if header.error:
        raise KVTransferError(f"the source could not send {request_id!r}: {header.error}")
    if header.request_id != request_id:
        raise KVTransferError(f"a reply for {header.request_id!r}, not {request_id!r}")
    block_size, heads, row, dtype = _geometry(caches)
    want = {
        "num_blocks": len(block_ids),
        "block_size": block_size,
        "num_layers": len(caches),
        "num_kv_heads": heads,
        "row": row,
        "dtype": dtype,
    }
    got = {k: getattr(header, k) for k in want}
    if got != want:
        diff = ", ".join(f"{k} {got[k]!r} (here {want[k]!r})" for k in want if got[k] != want[k])
        raise KVTransferError(f"the KV of {request_id!r} does not fit this cache: {diff}")
    if len(frames) != 2 * len(caches):
        raise KVTransferError(
            f"the KV of {request_id!r} came in {len(frames)} frames, {2 * len(caches)} expected"
        )
    itemsize = caches[0][0].element_size()
    size = len(block_ids) * block_size * heads * row * itemsize
    short = [i for i, f in enumerate(frames) if memoryview(f).nbytes != size]
    if short:
        raise KVTransferError(
            f"the KV of {request_id!r} is truncated: frame {short[0]} has "
            f"{memoryview(frames[short[0]]).nbytes} bytes, {size} expected"
        )
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0][0].device)
    shape = (len(block_ids), block_size, heads, row)
    for layer, (k, v) in enumerate(caches):
        for j, t in enumerate((k, v)):
            raw = torch.frombuffer(bytearray(frames[2 * layer + j]), dtype=torch.uint8)
            rows = raw.view(t.dtype).view(shape).to(t.device)
            t.index_copy_(0, index, rows)


class KVExporter:
    """A worker's end that others read KV from: the requests registered, and a thread
    answering `KVRead`s on a ROUTER socket bound at `endpoint`."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        caches: KVCaches,
        register_wait_s: float = REGISTER_WAIT_S,
    ) -> None:
        self.caches = caches
        self.register_wait_s = register_wait_s
        self._held: dict[str, list[int]] = {}
        self._cond = threading.Condition()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kv-export")
        self._thread.start()

    def register(self, request_id: str, block_ids: list[int]) -> None:
        with self._cond:
            self._held[request_id] = list(block_ids)
            self._cond.notify_all()

    def release(self, request_id: str) -> None:
        with self._cond:
            self._held.pop(request_id, None)

    @property
    def held(self) -> list[str]:
        with self._cond:
            return list(self._held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def answer(self, read: KVRead) -> tuple[KVBlocksHeader, list[memoryview]]:
        """The reply to one read (what the thread sends): the blocks, or an error."""
        deadline = time.monotonic() + self.register_wait_s
        with self._cond:
            while read.request_id not in self._held:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return KVBlocksHeader(read.request_id, "unknown request (never exported, or "
                                          "already released)"), []  # fmt: skip
                self._cond.wait(min(left, 0.1))
            held = self._held[read.request_id]
        if list(read.block_ids) != held:
            return KVBlocksHeader(read.request_id, f"block ids {read.block_ids[:8]} are not the "
                                  f"exported ones {held[:8]}"), []  # fmt: skip
        try:
            return pack_blocks(self.caches, read.request_id, held)
        except KVTransferError as e:
            return KVBlocksHeader(read.request_id, str(e)), []

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVRead)
        encoder = msgspec.msgpack.Encoder()
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    continue
                try:
                    read = decoder.decode(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    header, data = KVBlocksHeader("", f"bad read: {e}"), []
                else:
                    header, data = self.answer(read)
                sock.send_multipart([frames[0], encoder.encode(header), *data], copy=False)
        except zmq.ZMQError as e:  # the context went away with the worker
            log.debug("kv exporter stopped: %s", e)
        finally:
            sock.close(linger=0)


class KVImporter:
    """A worker's end that pulls KV from other instances: one thread, one job at a time;
    `done(seq_id, error, nbytes, seconds)` is called from that thread when a job ends
    (error "" = written; the bytes received and the seconds the pull took)."""

    def __init__(
        self,
        ctx: zmq.Context,
        caches: KVCaches,
        done: Callable[[int, str, int, float], None],
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.ctx, self.caches, self.done = ctx, caches, done
        self.read_timeout_s = read_timeout_s
        self._jobs: queue.Queue[tuple[int, str, str, list[int], list[int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-import")
        self._thread.start()

    def pull(
        self,
        seq_id: int,
        endpoint: str,
        source_request_id: str,
        source_block_ids: list[int],
        block_ids: list[int],
    ) -> None:
        """Queues a pull of `source_request_id`'s blocks `source_block_ids` at `endpoint`
        into this cache's `block_ids`; `done(seq_id, error)` tells how it went."""
        self._jobs.put((seq_id, endpoint, source_request_id, source_block_ids, block_ids))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=2.0)

    def fetch(
        self, endpoint: str, request_id: str, source_block_ids: list[int], block_ids: list[int]
    ) -> int:
        """One pull, synchronously; the bytes received (KVTransferError naming why it
        failed)."""
        if len(source_block_ids) != len(block_ids):
            raise KVTransferError(
                f"{len(source_block_ids)} source blocks for {len(block_ids)} blocks here"
            )
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(msgspec.msgpack.encode(KVRead(request_id, source_block_ids)))
            if not sock.poll(int(self.read_timeout_s * 1000)):
                raise KVTransferError(
                    f"no reply from {endpoint} for {request_id!r} in {self.read_timeout_s:g} s "
                    "(the prefill instance is gone?)"
                )
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)
        try:
            header = msgspec.msgpack.decode(frames[0].bytes, type=KVBlocksHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise KVTransferError(f"bad reply header for {request_id!r}: {e}") from None
        data = [f.buffer for f in frames[1:]]
        unpack_blocks(self.caches, request_id, block_ids, header, data)
        return sum(memoryview(d).nbytes for d in data)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq_id, endpoint, request_id, source_blocks, blocks = job
            error, nbytes, t0 = "", 0, time.perf_counter()
            try:
                nbytes = self.fetch(endpoint, request_id, source_blocks, blocks)
            except KVTransferError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - a pull must always be answered
                error = f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                self.done(seq_id, error, nbytes, time.perf_counter() - t0)
