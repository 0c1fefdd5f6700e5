"""Detokenizer process (one of M shards): token deltas in, text deltas out to the frontend."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq

from sarazmq.detokenizer import DetokenizerManager
from sarazmq.model.loader import load_tokenizer, resolve_model
from sarazmq.procs.common import (
    ProcSpec,
    pull_socket,
    push_socket,
    recv_interruptible,
    run_process,
)
from sarazmq.protocol import (
    DeltaBatch,
    DetokenizerAdd,
    DetokenizerInbound,
    OutputBatch,
    StopStringHit,
)
from sarazmq.text_stream import text_outputs


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    manager = DetokenizerManager(load_tokenizer(resolve_model(spec.config.model)))
    inbound = pull_socket(ctx, spec.endpoints.detokenizers[spec.index])
    frontend = push_socket(ctx, spec.endpoints.frontend_in)
    scheduler = push_socket(ctx, spec.endpoints.scheduler_in)
    decoder = msgspec.msgpack.Decoder(DetokenizerInbound)
    enc = msgspec.msgpack.Encoder()
    ready()
    while True:
        msg = decoder.decode(recv_interruptible(inbound))
        if isinstance(msg, DetokenizerAdd):
            manager.add(msg.request_id, msg.prompt_token_ids, msg.params)
        elif isinstance(msg, DeltaBatch):
            outputs, stop_hits = text_outputs(manager, msg.deltas)
            for rid in stop_hits:
                scheduler.send(enc.encode(StopStringHit(request_id=rid)))
            if outputs:
                frontend.send(enc.encode(OutputBatch(outputs)))


if __name__ == "__main__":
    run_process(body)
