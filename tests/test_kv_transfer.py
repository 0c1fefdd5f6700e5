"""Moving KV blocks between instances (sarazmq.worker.kv_transfer): the wire format's
checks (a malformed or truncated reply writes nothing), and the exporter and importer
over real ZeroMQ sockets (unknown and released requests, wrong blocks, a silent source)."""

from __future__ import annotations

import re
import threading

import pytest
import torch
import zmq

from sarazmq.worker.kv_transfer import (
    KVBlocksHeader,
    KVExporter,
    KVImporter,
    KVRead,
    KVTransferError,
    pack_blocks,
    unpack_blocks,
)


def _caches(layers: int = 3, blocks: int = 12, dtype: torch.dtype = torch.float32, row: int = 8):
    g = torch.Generator().manual_seed(layers * blocks + row)
    out = []
    for _ in range(layers):
        k = torch.randn(blocks, 4, 2, row, generator=g).to(dtype)
        v = torch.randn(blocks, 4, 2, row, generator=g).to(dtype)
        out.append((k, v))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_blocks_arrive_bitwise_in_other_block_ids(dtype: torch.dtype) -> None:
    src = _caches(dtype=dtype)
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    header, frames = pack_blocks(src, "req", [7, 2, 5])
    unpack_blocks(dst, "req", [0, 1, 11], header, frames)
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(d[[0, 1, 11]], s[[7, 2, 5]])
            assert not d[2:11].any()  # nothing else written


def test_a_reply_that_does_not_fit_writes_nothing() -> None:
    src, dst = _caches(), _caches(layers=3)
    before = [(k.clone(), v.clone()) for k, v in dst]
    header, frames = pack_blocks(src, "req", [1, 2])

    def untouched() -> bool:
        return all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(before, dst))

    cases = [
        (header, frames[:-1], "came in 5 frames, 6 expected"),
        (header, [*frames[:-1], frames[-1][:-4]], "truncated: frame 5"),
        (KVBlocksHeader(**{**_fields(header), "row": 16}), frames, "row 16 (here 8)"),
        (KVBlocksHeader(**{**_fields(header), "dtype": "float16"}), frames, "dtype 'float16'"),
        (KVBlocksHeader(**{**_fields(header), "request_id": "other"}), frames, "for 'other'"),
        (KVBlocksHeader("req", "gone"), [], "could not send 'req': gone"),
    ]
    for head, data, match in cases:
        with pytest.raises(KVTransferError, match=re.escape(match)):
            unpack_blocks(dst, "req", [3, 4], head, data)
        assert untouched()
    with pytest.raises(KVTransferError, match=re.escape("num_blocks 2 (here 3)")):
        unpack_blocks(dst, "req", [3, 4, 5], header, frames)
    with pytest.raises(KVTransferError, match="not in \\[0, 12\\)"):
        pack_blocks(src, "req", [12])


def _fields(h: KVBlocksHeader) -> dict:
    return {f: getattr(h, f) for f in h.__struct_fields__}


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_export_then_pull_over_sockets(ctx: zmq.Context, tmp_path) -> None:
    src = _caches()
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    endpoint = f"ipc://{tmp_path}/kv.ipc"
    exporter = KVExporter(ctx, endpoint, src, register_wait_s=0.3)
    results: dict[int, str] = {}
    got = threading.Event()

    def done(seq_id: int, error: str, nbytes: int, seconds: float) -> None:
        results[seq_id] = error
        got.set()

    importer = KVImporter(ctx, dst, done, read_timeout_s=2.0)
    try:
        exporter.register("p1", [4, 9])
        importer.pull(1, endpoint, "p1", [4, 9], [0, 6])
        assert got.wait(5) and results[1] == ""
        assert torch.equal(dst[2][1][[0, 6]], src[2][1][[4, 9]])
        # another request's blocks, or the wrong ones, are refused by the exporter
        for seq, rid, blocks, why in ((2, "nobody", [1], "unknown request"),
                                      (3, "p1", [4, 8], "not the exported ones")):  # fmt: skip
            got.clear()
            importer.pull(seq, endpoint, rid, blocks, [1] * len(blocks))
            assert got.wait(5) and why in results[seq]
        # released: a second pull of the same KV is refused, nothing written
        exporter.release("p1")
        assert exporter.held == []
        got.clear()
        dst[0][0][3].fill_(7.0)
        importer.pull(4, endpoint, "p1", [4, 9], [3, 5])
        assert got.wait(5) and "unknown request" in results[4]
        assert (dst[0][0][3] == 7.0).all()
        # a garbled read gets an error reply, not silence
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send(b"\xc1garbage")
        assert dealer.poll(2000)
        import msgspec

        reply = msgspec.msgpack.decode(dealer.recv_multipart()[0], type=KVBlocksHeader)
        assert "bad read" in reply.error
        dealer.close(linger=0)
        assert isinstance(KVRead("x", [1]), KVRead)
    finally:
        importer.close()
        exporter.close()


def test_a_silent_source_is_an_error_within_the_timeout(ctx: zmq.Context, tmp_path) -> None:
    results: dict[int, str] = {}
    got = threading.Event()
    importer = KVImporter(ctx, _caches(), lambda s, e, *_: (results.__setitem__(s, e), got.set()),
                          read_timeout_s=0.3)  # fmt: skip
    try:
        importer.pull(9, f"ipc://{tmp_path}/nobody.ipc", "p", [1], [2])
        assert got.wait(5) and "no reply" in results[9]
        got.clear()
        importer.pull(10, f"ipc://{tmp_path}/nobody.ipc", "p", [1, 2], [3])
        assert got.wait(5) and "2 source blocks for 1" in results[10]
    finally:
        importer.close()
