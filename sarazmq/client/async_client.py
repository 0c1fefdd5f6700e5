"""`AsyncClient`: the asyncio client SDK of a sarazmq deployment.

One DEALER connection carries any number of concurrent requests. A reader task
dispatches server frames to per-request queues and answers the engine's heartbeats
(`Pong`: the engine aborts the requests of a client that stops answering). The engine
sends heartbeats while requests are in flight, so a dead or unreachable engine becomes an
`EngineError` within `heartbeat_timeout` seconds instead of a hang; a dropped connection
or a failed CurveZMQ handshake fails the pending requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from sarazmq.client.errors import EngineError, HealthReport, RequestError
from sarazmq.outputs import RequestOutput
from sarazmq.protocol.client import (
    AbortRequest,
    ChatMessage,
    ClientMessage,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ProtocolError,
    ResetPrefixCacheRequest,
    ServerMessage,
    StatsReply,
    StatsRequest,
)
from sarazmq.protocol.common import FINISH_ERROR
from sarazmq.sampling_params import SamplingParams

Prompt = str | Sequence[int]


# frames the reader takes in a row before it lets the event loop run other tasks
READ_BATCH = 256

_MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class AsyncClient:
    """Async client: `generate`, `stream`, `chat`, `abort`, `stats` over one connection.

    endpoint: the deployment's public endpoint (ipc://... or tcp://host:port).
    timeout: default per-request deadline in seconds (None = no deadline).
    heartbeat_timeout: seconds without any frame from the engine, while requests are in
        flight, after which every pending request fails with EngineError.
    curve_server_key / curve_keypair: CurveZMQ keys (z85 bytes) for a tcp deployment
        that requires them.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = None,
        heartbeat_timeout: float = 5.0,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[OutputDelta | Exception]] = {}
        self._stats_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerMessage)
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{id(self):x}"
        self._last_heard = time.monotonic()
        self._closed = False

    # ---- connection --------------------------------------------------------------

    def _ensure_connected(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise EngineError("client is closed")
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # take everything the engine sends as fast as it comes: the engine drops a
            # client whose queue on its side fills up
            sock.setsockopt(zmq.RCVHWM, 0)
            if self._curve_server_key is not None:
                public, secret = self._curve_keypair or zmq.curve_keypair()
                sock.curve_serverkey = self._curve_server_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            sock.connect(self.endpoint)
            self._sock = sock
            self._last_heard = time.monotonic()
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_loop())
            self._monitor = loop.create_task(self._monitor_loop(monitor))
        return self._sock

    async def close(self) -> None:
        """Drops the connection (the engine then aborts this client's requests); pending
        requests fail here with EngineError."""
        self._closed = True
        for task in (self._reader, self._monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._fail_all(EngineError("client closed"))
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail_all(self, err: Exception) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(err)

    async def _read_loop(self) -> None:
        assert self._sock is not None  # set before the task starts
        sock = self._sock
        # the same socket without the asyncio layer: once a poll says frames are waiting,
        # they are taken without a future and a poller registration each (the asyncio
        # socket's next poll checks for frames already there, so none is missed)
        frames = zmq.Socket.shadow(sock.underlying)
        while True:
            if await sock.poll(timeout=250) == 0:
                pending = self._queues or self._stats_waiters
                silent = time.monotonic() - self._last_heard
                if pending and silent > self.heartbeat_timeout:
                    self._fail_all(
                        EngineError(
                            f"engine at {self.endpoint} is unreachable or dead: no message "
                            f"for {silent:.1f} s"
                        )
                    )
                    self._last_heard = time.monotonic()
                if not pending:
                    self._last_heard = time.monotonic()
                continue
            self._last_heard = time.monotonic()
            # at most READ_BATCH frames before the event loop runs anything else
            self._take_received(frames, READ_BATCH)

    def _take_received(self, sock: zmq.Socket, limit: int | None = None) -> None:
        """Handles the frames already received on `sock` (up to `limit`), without waiting."""
        taken = 0
        while limit is None or taken < limit:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_frame(frame, sock)
            taken += 1

    def _handle_frame(self, frame: bytes, sock: zmq.Socket) -> None:
        try:
            msg = self._decoder.decode(frame)
        except Exception:  # noqa: BLE001 - DecodeError, RecursionError: not ours to crash on
            return
        if isinstance(msg, OutputDelta):
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, StatsReply):
            fut = self._stats_waiters.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, Heartbeat):
            # proof that this client still reads; NOBLOCK: never wait on the engine
            with contextlib.suppress(zmq.ZMQError):
                sock.send(self._encoder.encode(Pong(time=msg.time)), zmq.NOBLOCK)
        elif isinstance(msg, ProtocolError):
            self._fail_all(EngineError(f"engine rejected a frame: {msg.error}"))

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        """Fails pending requests as soon as the connection drops or a handshake fails."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    err = f"lost the connection to the engine at {self.endpoint}"
                else:
                    err = (
                        f"security handshake with the engine at {self.endpoint} failed "
                        f"(wrong or missing CurveZMQ server key?)"
                    )
                pending = self._queues or self._stats_waiters
                if pending and self._sock is not None:
                    # what the engine sent before the connection dropped (a drain's
                    # finals, say) may still wait unread here: it goes first, so a request
                    # that finished does not end in the error instead
                    self._take_received(zmq.Socket.shadow(self._sock.underlying))
                if self._queues or self._stats_waiters:  # those still without an answer
                    self._fail_all(EngineError(err))
        finally:
            monitor.close(linger=0)

    async def _send(self, msg: ClientMessage) -> None:
        sock = self._ensure_connected()
        try:
            frame = self._encoder.encode(msg)
        except OverflowError as e:  # an int the wire's int64 cannot carry
            raise ValueError(f"cannot send the request: {e}") from None
        await sock.send(frame)

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    # ---- requests ----------------------------------------------------------------

    async def stream(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[OutputDelta]:
        """Yields deltas (text concatenates to the final text); the last has finish_reason.

        Leaving the iteration early aborts the request on the engine.
        """
        rid = request_id or self.new_request_id()
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in flight on this client")
        req = GenerateRequest(request_id=rid, params=params or SamplingParams())
        if messages is not None:
            req.messages = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        elif isinstance(prompt, str):
            req.prompt = prompt
        elif prompt is not None:
            req.prompt_token_ids = list(prompt)
        else:
            raise ValueError("give a prompt (text or token ids) or messages")
        deadline_s = timeout if timeout is not None else self.timeout
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        q: asyncio.Queue[OutputDelta | Exception] = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            await self._send(req)
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = await asyncio.wait_for(q.get(), wait)
                except asyncio.TimeoutError:
                    raise EngineError(f"request {rid} timed out after {deadline_s} s") from None
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finish_reason == FINISH_ERROR:
                    finished = True
                    raise RequestError(
                        rid, item.error or "request failed", item.error_field, item.error_type
                    )
                if item.finish_reason:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished and not self._closed and self._sock is not None:
                with contextlib.suppress(Exception):
                    await self._send(AbortRequest(request_id=rid))

    async def generate(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        """Runs one request to the end and returns its full output and server timestamps."""
        rid = request_id or self.new_request_id()
        out = RequestOutput(request_id=rid)
        async for delta in self.stream(
            prompt, params, messages=messages, request_id=rid, timeout=timeout
        ):
            out.apply(delta)
        return out

    async def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        stream: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """The assistant's reply to a conversation (chat template applied by the engine).

        stream=True returns an async iterator of deltas instead of the final output.
        """
        if stream:
            return self.stream(
                None, params, messages=messages, request_id=request_id, timeout=timeout
            )
        return await self.generate(
            None, params, messages=messages, request_id=request_id, timeout=timeout
        )

    async def abort(self, request_id: str) -> None:
        """Asks the engine to stop a request; its stream ends with finish_reason="abort"."""
        await self._send(AbortRequest(request_id=request_id))

    async def stats(self, timeout: float = 10.0, iterations_from: int = -1) -> dict[str, Any]:
        """Scheduler state: num_waiting, num_running, num_free_blocks, num_total_blocks,
        num_iterations, num_preemptions, num_finished; with iterations_from >= 0 also
        "iterations": the per-iteration records (step, start, end, num_prefill_tokens,
        num_decode_tokens, num_seqs, ...) since that step."""
        rid = self.new_request_id()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[rid] = fut
        try:
            await self._send(StatsRequest(request_id=rid, iterations_from=iterations_from))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"stats request timed out after {timeout} s") from None
        finally:
            self._stats_waiters.pop(rid, None)

    async def reset_prefix_cache(self, timeout: float = 10.0) -> None:
        """Makes the engine forget every cached prefix block (e.g. before a benchmark).
        Raises EngineError saying why when refused: the engine must be idle (no request
        holding KV blocks)."""
        rid = self.new_request_id()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[rid] = fut
        try:
            await self._send(ResetPrefixCacheRequest(request_id=rid))
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"reset_prefix_cache timed out after {timeout} s") from None
        finally:
            self._stats_waiters.pop(rid, None)
        if not reply.get("reset"):
            why = reply.get("error") or reply.get("dead") or "no answer"
            raise EngineError(f"reset_prefix_cache refused: {why}")

    async def health(self, timeout: float = 10.0) -> HealthReport:
        """Runs a real one-token generation (tokenizer, scheduler, worker, detokenizer)
        under `timeout` seconds; reports healthy or why not. Never raises."""
        t0 = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        try:
            out = await self.generate("Hi", params, timeout=timeout)
        except EngineError as e:
            return HealthReport(healthy=False, reason=str(e), latency_s=time.monotonic() - t0)
        latency = time.monotonic() - t0
        if out.finish_reason not in ("stop", "length") or len(out.token_ids) != 1:
            reason = f"one-token generation ended {out.finish_reason!r} with {out.token_ids}"
            return HealthReport(healthy=False, reason=reason, latency_s=latency)
        try:
            stats = await self.stats(timeout=max(1.0, timeout - latency))
        except EngineError:
            stats = {}
        return HealthReport(healthy=True, latency_s=latency, stats=stats)
