"""Frontend process: the public ROUTER endpoint; tokenizes, forwards, routes outputs back."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from sarazmq.frontend import Frontend, FrontendActions
from sarazmq.model.loader import load_tokenizer, resolve_model
from sarazmq.procs.common import ProcSpec, run_process
from sarazmq.protocol import MAX_CLIENT_FRAME_BYTES, FrontendInbound
from sarazmq.tokenizer_manager import TokenizerManager

HEARTBEAT_INTERVAL_S = 1.0
log = logging.getLogger("sarazmq.frontend")


def bind_public(ctx: zmq.asyncio.Context, spec: ProcSpec) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_FRAME_BYTES)
    # a client that cannot take its output must not block everyone: drop to it instead
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    if spec.curve is not None:
        sock.curve_server = True
        sock.curve_publickey = spec.curve.public.encode()
        sock.curve_secretkey = spec.curve.secret.encode()
    endpoint = spec.endpoints.public
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)
    return sock


async def serve(spec: ProcSpec, ready: Callable[..., None]) -> None:
    tokenizer = load_tokenizer(resolve_model(spec.config.model))
    frontend = Frontend(
        TokenizerManager(
            tokenizer, spec.model_config.vocab_size, spec.config.scheduler.max_model_len
        )
    )
    ctx = zmq.asyncio.Context()
    public = bind_public(ctx, spec)
    inbound = ctx.socket(zmq.PULL)
    inbound.setsockopt(zmq.LINGER, 0)
    inbound.bind(spec.endpoints.frontend_in)
    scheduler = ctx.socket(zmq.PUSH)
    scheduler.setsockopt(zmq.LINGER, 1000)
    scheduler.connect(spec.endpoints.scheduler_in)
    enc = msgspec.msgpack.Encoder()
    in_decoder = msgspec.msgpack.Decoder(FrontendInbound)

    async def apply(acts: FrontendActions) -> None:
        for msg in acts.to_scheduler:
            await scheduler.send(enc.encode(msg))
        for identity, reply in acts.to_clients:
            await public.send_multipart([identity, enc.encode(reply)])

    async def from_clients() -> None:
        while True:
            frames = await public.recv_multipart()
            if len(frames) != 2:
                continue  # a DEALER sends [identity, payload]; anything else is not ours
            await apply(frontend.on_client_frame(frames[0], frames[1]))

    async def from_engine() -> None:
        while True:
            frame = await inbound.recv()
            try:
                msg = in_decoder.decode(frame)
            except msgspec.DecodeError as e:  # a bug elsewhere must not take the endpoint down
                log.error("undecodable internal message: %s", e)
                continue
            await apply(frontend.on_engine_message(msg))

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            for identity, msg in frontend.heartbeats():
                await public.send_multipart([identity, enc.encode(msg)])

    ready(endpoint=spec.endpoints.public)
    await asyncio.gather(from_clients(), from_engine(), heartbeat())


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    runner(serve(spec, ready))


if __name__ == "__main__":
    run_process(body)
