"""The async client's reader against a scripted engine socket (no deployment): frames
that pile up before it reads are all delivered, in order, to the right request, with a
heartbeat among them answered, and another request's frames do not leak into it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from sarazmq.client.async_client import READ_BATCH, AsyncClient
from sarazmq.client.errors import EngineError
from sarazmq.protocol.client import (
    ClientMessage,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ServerMessage,
)


async def _engine(router: zmq.asyncio.Socket, burst: int) -> list[ClientMessage]:
    """Answers the first two requests: the first one's `burst` tokens (a heartbeat in the
    middle) and the second one's three, interleaved, all sent before the client can read
    any, then both finishes; returns what the client sent back after that."""
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(ClientMessage)
    requests = []
    while len(requests) < 2:
        ident, frame = await router.recv_multipart()
        msg = dec.decode(frame)
        assert isinstance(msg, GenerateRequest)
        requests.append(msg.request_id)
    first, second = requests
    frames: list[ServerMessage] = []
    for i in range(burst):
        frames.append(OutputDelta(request_id=first, text=f"{i},", token_ids=[i]))
        if i == burst // 2:
            frames.append(Heartbeat(time=12.5))
        if i % 100 == 0 and i // 100 < 3:
            frames.append(OutputDelta(request_id=second, token_ids=[-i]))
    frames.append(OutputDelta(request_id=first, finish_reason="length"))
    frames.append(OutputDelta(request_id=second, finish_reason="stop"))
    for f in frames:
        await router.send_multipart([ident, enc.encode(f)])
    replies = []
    while True:
        try:
            _, frame = await asyncio.wait_for(router.recv_multipart(), 5.0)
        except asyncio.TimeoutError:
            return replies
        replies.append(dec.decode(frame))
        if isinstance(replies[-1], Pong):
            return replies


async def _collect(client: AsyncClient, prompt: list[int]) -> tuple[str, list[int], str]:
    text, tokens, reason = "", [], ""
    async for d in client.stream(prompt):
        text += d.text
        tokens += d.token_ids
        reason = d.finish_reason
    return text, tokens, reason


def test_a_pile_of_frames_arrives_whole_and_in_order(tmp_path: Path) -> None:
    burst = 4 * READ_BATCH + 17  # several reads' worth, not a multiple of one

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        # the burst is bigger than the default send queue (1,000): a loaded machine's I/O
        # thread moves it to the client slower than it is sent, and a plain ROUTER then
        # drops frames silently; the frontend's ROUTER fails such a send instead
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        endpoint = f"ipc://{tmp_path}/engine.ipc"
        router.bind(endpoint)
        client = AsyncClient(endpoint, timeout=30.0)
        try:
            engine = asyncio.create_task(_engine(router, burst))
            first = asyncio.create_task(_collect(client, [1, 2, 3]))
            await asyncio.sleep(0.05)  # the first request reaches the engine first
            second = asyncio.create_task(_collect(client, [4]))
            (text, tokens, reason), other, replies = await asyncio.gather(first, second, engine)
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()
        assert tokens == list(range(burst))
        assert text == "".join(f"{i}," for i in range(burst))
        assert reason == "length"
        assert other == ("", [0, -100, -200], "stop")
        assert any(isinstance(r, Pong) and r.time == 12.5 for r in replies)

    asyncio.run(main())


def test_frames_sent_before_the_engine_goes_away_arrive_before_the_error(
    tmp_path: Path,
) -> None:
    # A drain ends with the engine sending each request's final ("abort") and closing: a
    # client that reads slower than tokens came still has frames waiting when it sees
    # the connection drop. They are delivered first; only requests left without a final
    # get the "lost the connection" error.
    import threading
    import time

    burst = 4 * READ_BATCH + 5
    endpoint = f"ipc://{tmp_path}/engine.ipc"
    bound, gone = threading.Event(), threading.Event()

    def engine() -> None:  # its own thread and context: runs while the client's loop sleeps
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(ClientMessage)
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)
        router.bind(endpoint)
        bound.set()
        rids = {}  # first prompt token -> request id
        while len(rids) < 2:
            ident, frame = router.recv_multipart()
            msg = dec.decode(frame)
            if isinstance(msg, GenerateRequest) and msg.prompt_token_ids:
                rids[msg.prompt_token_ids[0]] = msg.request_id
        finished = rids[1]  # the other one ([9]) gets nothing: it is left without a final
        router.send_multipart([ident, enc.encode(OutputDelta(request_id=finished, text="s"))])
        time.sleep(0.3)  # the client takes that one, then stops reading (see below)
        for i in range(burst):
            router.send_multipart(
                [ident, enc.encode(OutputDelta(request_id=finished, token_ids=[i]))]
            )
        final = OutputDelta(request_id=finished, finish_reason="abort")
        router.send_multipart([ident, enc.encode(final)])
        router.close(linger=10_000)  # everything reaches the client's side, then it drops
        ctx.term()
        gone.set()

    thread = threading.Thread(target=engine)
    thread.start()
    assert bound.wait(10)

    async def main() -> tuple[list[int], str, str]:
        client = AsyncClient(endpoint, timeout=30.0)
        tokens, reason, other_error = [], "", ""
        try:
            other = asyncio.create_task(_collect(client, [9]))
            stream = client.stream([1, 2, 3])
            first = await stream.__anext__()
            assert first.text == "s"
            # the client's loop is busy elsewhere while the engine sends and goes away
            assert gone.wait(20)
            time.sleep(0.5)  # its I/O thread sees the disconnect too
            async for d in stream:
                tokens += d.token_ids
                reason = d.finish_reason
            try:
                await other
            except EngineError as e:
                other_error = str(e)
        finally:
            await client.close()
        return tokens, reason, other_error

    tokens, reason, other_error = asyncio.run(main())
    thread.join(10)
    assert tokens == list(range(burst)) and reason == "abort"
    assert "lost the connection" in other_error
