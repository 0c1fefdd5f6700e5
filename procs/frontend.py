"""Frontend process: the public ROUTER endpoint; tokenizes, forwards, routes outputs back.

Nothing a client does can block or crash this loop:
- frames are decoded by `Frontend` (which never raises on their content); libzmq drops
  the connection of a peer whose frame exceeds MAX_CLIENT_FRAME_BYTES (`public_router`);
- sends to clients never block: ROUTER_MANDATORY + NOBLOCK, and a client whose
  per-peer queue (SNDHWM = DeploymentConfig.max_client_backlog messages) is full, or that is no longer
  connected (EHOSTUNREACH), is treated as gone: its requests are aborted. A client with
  requests in flight gets a delta each iteration or a heartbeat each second, so a
  disconnect is noticed within about a second (libzmq's ROUTER_NOTIFY would say so
  directly, but it is a draft API that pyzmq's libzmq is built without);
- a client with requests in flight must answer heartbeats (`Pong`) within
  DeploymentConfig.client_timeout seconds, or it is treated as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    FrontendActions,
    FrontendService,
    PromptTokenizer,
)
from sarazmq.model.source import load_tokenizer, resolve_model
from sarazmq.procs.common import ProcSpec, async_body, run_process
from sarazmq.procs.sockets import public_router, pull_socket, push_socket
from sarazmq.protocol.engine import FrontendInbound, InstanceDown
from sarazmq.protocol.launcher import Drained
from sarazmq.router import build_router

HEARTBEAT_INTERVAL_S = 1.0
TICK_S = 0.2
# how long the public socket may hold its last messages at exit (stop_children's grace is 5 s)
FINALS_FLUSH_MS = 2000
log = logging.getLogger("sarazmq.frontend")


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
    cfg, dep = spec.config, spec.deployment
    tokenizer = load_tokenizer(resolve_model(cfg.model, cfg.load_format))
    frontend = FrontendService(
        PromptTokenizer(
            tokenizer,
            spec.model_config.vocab_size,
            cfg.scheduler.max_model_len,
            max_kv_tokens=cfg.cache.num_blocks * cfg.cache.block_size,
        ),
        client_timeout=dep.client_timeout,
        router=build_router(cfg),
    )
    ctx = zmq.asyncio.Context()
    public = public_router(ctx, spec.endpoints.public, dep.curve, dep.max_client_backlog)
    inbound = pull_socket(ctx, spec.endpoints.frontend_in)
    schedulers = [push_socket(ctx, inst.scheduler_in) for inst in spec.endpoints.instances]
    launcher = push_socket(ctx, spec.endpoints.launcher)
    enc = msgspec.msgpack.Encoder()
    in_decoder = msgspec.msgpack.Decoder(FrontendInbound)
    sender = ClientSender(public)
    drained_sent = False

    async def apply(acts: FrontendActions) -> None:
        pending = [acts]
        while pending:
            a = pending.pop()
            for instance, msg in zip(a.to_instance, a.to_scheduler, strict=True):
                await schedulers[instance].send(enc.encode(msg))
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
            except Exception as e:  # noqa: BLE001 - one bad client must not take the endpoint down
                log.exception("error handling a message from client %s", identity.hex())
                acts = frontend.handler_failed(identity, frames[-1], e)
            try:
                await apply(acts)
            except Exception:  # noqa: BLE001 - as above
                log.exception("error answering a message from client %s", identity.hex())

    async def from_engine() -> None:
        while True:
            frame = await inbound.recv()
            try:
                msg = in_decoder.decode(frame)
            except msgspec.DecodeError as e:  # a bug elsewhere must not take the endpoint down
                log.error("undecodable internal message: %s", e)
                continue
            if isinstance(msg, InstanceDown) and 0 <= msg.instance < len(schedulers):
                # what was queued for the dead scheduler must not reach its successor
                schedulers[msg.instance].close(linger=0)
                schedulers[msg.instance] = push_socket(
                    ctx, spec.endpoints.instances[msg.instance].scheduler_in
                )
            await apply(frontend.on_engine_message(msg))
            await check_drained()

    async def ticker() -> None:
        next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            await asyncio.sleep(TICK_S)
            acts = frontend.drain_tick()
            for identity in frontend.expired_clients():
                gone = frontend.on_client_gone(identity, GONE_TIMEOUT)
                acts.extend(gone)
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
            # a drain's finals (aborts at its deadline) may still be queued for a client
            # that reads slower than tokens came: they get FINALS_FLUSH_MS to go out (within
            # the launcher's grace after SIGTERM); every other socket closes at once
            public.close(linger=FINALS_FLUSH_MS)
            ctx.destroy(linger=0)


body = async_body(serve)

if __name__ == "__main__":
    run_process(body)
