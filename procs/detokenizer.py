"""Detokenizer process (one of M shards): token deltas in, text deltas out to the frontend."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq

from sarazmq.detokenizer import DetokenizerService
from sarazmq.model.source import load_decoding_tokenizer, resolve_model
from sarazmq.procs.common import ProcSpec, recv_interruptible, run_process
from sarazmq.procs.sockets import pull_socket, push_socket
from sarazmq.protocol.engine import DetokenizerInbound, OutputBatch, StopStringHit


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    tokenizer, eos_token_ids = load_decoding_tokenizer(
        resolve_model(spec.config.model, spec.config.load_format)
    )
    service = DetokenizerService(tokenizer, eos_token_ids)
    inbound = pull_socket(ctx, spec.own.detokenizers[spec.index])
    frontend = push_socket(ctx, spec.endpoints.frontend_in)
    scheduler = push_socket(ctx, spec.own.scheduler_in)
    decoder = msgspec.msgpack.Decoder(DetokenizerInbound)
    enc = msgspec.msgpack.Encoder()
    ready()
    while True:
        result = service.on_message(decoder.decode(recv_interruptible(inbound)))
        for rid in result.stop_hits:
            scheduler.send(enc.encode(StopStringHit(request_id=rid)))
        if result.outputs:
            frontend.send(enc.encode(OutputBatch(result.outputs)))


if __name__ == "__main__":
    run_process(body)
