"""Frontend process: the public ROUTER endpoint; tokenizes, forwards, routes outputs back.

Nothing a client does can block or crash this loop:
- frames are decoded by `Frontend` (which never raises on their content); libzmq drops
  the connection of a peer whose frame exceeds MAX_CLIENT_FRAME_BYTES;
- sends to clients never block: ROUTER_MANDATORY + NOBLOCK, and a client whose
  per-peer queue (SNDHWM = max_client_backlog messages) is full, or that is no longer
  connected (EHOSTUNREACH), is treated as gone: its requests are aborted. A client with
  requests in flight gets a delta each iteration or a heartbeat each second, so a
  disconnect is noticed within about a second (libzmq's ROUTER_NOTIFY would say so
  directly, but it is a draft API that pyzmq's libzmq is built without);
- a client with requests in flight must answer heartbeats (`Pong`) within
  client_timeout seconds, or it is treated as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from sarazmq.frontend import (
    GONE_BACKLOG,
    GONE_TIMEOUT,
    GONE_UNREACHABLE,
    REJECT_MULTIPART,
    ClientReply,
    Frontend,
    FrontendActions,
)
from sarazmq.model.loader import load_tokenizer, resolve_model
from sarazmq.procs.common import ProcSpec, Stopped, run_process
from sarazmq.protocol import MAX_CLIENT_FRAME_BYTES, Drained, FrontendInbound
from sarazmq.tokenizer_manager import TokenizerManager

HEARTBEAT_INTERVAL_S = 1.0
TICK_S = 0.2
log = logging.getLogger("sarazmq.frontend")


def bind_public(ctx: zmq.Context, spec: ProcSpec) -> zmq.Socket:
    """The public ROUTER: size-capped frames, routed sends that fail instead of block."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_FRAME_BYTES)
    # a send to an unknown/disconnected peer, or one whose queue is full, raises instead
    # of being dropped silently (a silently dropped final delta would hang that client)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, spec.max_client_backlog)
    if spec.curve is not None:
        sock.curve_server = True
        sock.curve_publickey = spec.curve.public.encode()
        sock.curve_secretkey = spec.curve.secret.encode()
    endpoint = spec.endpoints.public
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        # already 0600 (the process umask is 077); say so explicitly for a given path
        os.chmod(endpoint[len("ipc://") :], 0o600)
    return sock


class ClientSender:
    """Sends to clients without ever blocking; reports the clients it could not reach."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self.enc = msgspec.msgpack.Encoder()

    async def send(self, replies: list[ClientReply]) -> list[tuple[bytes, str]]:
        """Sends each reply; returns (identity, why) for every client found gone."""
        gone: dict[bytes, str] = {}
        for identity, reply in replies:
            if identity in gone:
                continue
            try:
                # with NOBLOCK, zmq.asyncio tries the send at once and never waits
                await self.sock.send_multipart(
                    [identity, self.enc.encode(reply)], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                gone[identity] = GONE_BACKLOG
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                gone[identity] = GONE_UNREACHABLE
        return list(gone.items())


async def serve(spec: ProcSpec, ready: Callable[..., None]) -> None:
    tokenizer = load_tokenizer(resolve_model(spec.config.model))
    frontend = Frontend(
        TokenizerManager(
            tokenizer, spec.model_config.vocab_size, spec.config.scheduler.max_model_len
        ),
        client_timeout=spec.client_timeout,
    )
    ctx = zmq.asyncio.Context()
    public = bind_public(ctx, spec)
    inbound = ctx.socket(zmq.PULL)
    inbound.setsockopt(zmq.LINGER, 0)
    inbound.bind(spec.endpoints.frontend_in)
    scheduler = ctx.socket(zmq.PUSH)
    scheduler.setsockopt(zmq.LINGER, 1000)
    scheduler.connect(spec.endpoints.scheduler_in)
    launcher = ctx.socket(zmq.PUSH)
    launcher.setsockopt(zmq.LINGER, 1000)
    launcher.connect(spec.endpoints.launcher)
    enc = msgspec.msgpack.Encoder()
    in_decoder = msgspec.msgpack.Decoder(FrontendInbound)
    sender = ClientSender(public)
    drained_sent = False

    async def apply(acts: FrontendActions) -> None:
        pending = [acts]
        while pending:
            a = pending.pop()
            for msg in a.to_scheduler:
                await scheduler.send(enc.encode(msg))
            for identity, why in await sender.send(a.to_clients):
                pending.append(frontend.on_client_gone(identity, why))

    async def check_drained() -> None:
        nonlocal drained_sent
        if frontend.drained and not drained_sent:
            drained_sent = True
            log.info(
                "drained: %d finished, %d aborted", frontend.drain_finished, frontend.drain_aborted
            )
            await launcher.send(
                enc.encode(Drained(frontend.drain_finished, frontend.drain_aborted))
            )

    async def from_clients() -> None:
        while True:
            frames = await public.recv_multipart()
            identity = frames[0]
            try:
                if len(frames) != 2:
                    acts = frontend.reject_frame(
                        identity,
                        REJECT_MULTIPART,
                        f"a message must be exactly one frame, got {len(frames) - 1}",
                    )
                else:
                    acts = frontend.on_client_frame(identity, frames[1])
                await apply(acts)
            except Exception:  # noqa: BLE001 - one bad client must not take the endpoint down
                log.exception("error handling a message from client %s", identity.hex())

    async def from_engine() -> None:
        while True:
            frame = await inbound.recv()
            try:
                msg = in_decoder.decode(frame)
            except msgspec.DecodeError as e:  # a bug elsewhere must not take the endpoint down
                log.error("undecodable internal message: %s", e)
                continue
            await apply(frontend.on_engine_message(msg))
            await check_drained()

    async def ticker() -> None:
        next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            await asyncio.sleep(TICK_S)
            acts = frontend.drain_tick()
            for identity in frontend.expired_clients():
                gone = frontend.on_client_gone(identity, GONE_TIMEOUT)
                acts.to_scheduler.extend(gone.to_scheduler)
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
                acts.to_clients.extend(frontend.heartbeats())
            await apply(acts)
            await check_drained()

    # SIGTERM (from the launcher, after the drain) ends the loop; run_process exits 0
    main = asyncio.current_task()
    assert main is not None  # serve() runs as the loop's main task
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    ready(endpoint=spec.endpoints.public)
    try:
        await asyncio.gather(from_clients(), from_engine(), ticker())
    finally:
        with contextlib.suppress(Exception):
            ctx.destroy(linger=0)


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(serve(spec, ready))
    except asyncio.CancelledError:
        raise Stopped from None


if __name__ == "__main__":
    run_process(body)
