"""Generations of the HTTP server: opened (first delta in hand, so a rejection is a proper
HTTP error), collected into one output, or streamed as OpenAI server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from sarazmq.api import responses
from sarazmq.api.encoding import SSE_DONE, sse_event
from sarazmq.api.errors import APIError, openai_param
from sarazmq.client import AsyncClient, EngineError, RequestError
from sarazmq.outputs import RequestOutput
from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import ERROR_INVALID, ERROR_OVERLOADED

#: seconds a client told "overloaded" should wait before retrying
RETRY_AFTER_S = 1


class Generation:
    """One request's stream with its first delta already received."""

    def __init__(self, stream: AsyncIterator[OutputDelta], first: OutputDelta) -> None:
        self._stream = stream
        self.first = first

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        yield self.first
        if self.first.finish_reason:
            return
        async for delta in self._stream:
            yield delta

    async def collect(self) -> RequestOutput:
        out = RequestOutput(request_id=self.first.request_id)
        async for delta in self.deltas():
            out.apply(delta)
        return out

    async def close(self) -> None:
        """Ends the stream early (aborts the request on the engine if it still runs)."""
        with contextlib.suppress(Exception):
            await self._stream.aclose()  # type: ignore[attr-defined]


def api_error(err: Exception, prompt_param: str) -> APIError:
    """The HTTP error for an engine-side failure of a request."""
    if isinstance(err, RequestError):
        if err.error_type == ERROR_INVALID:
            return APIError(400, str(err), param=openai_param(err.field, prompt_param))
        if err.error_type == ERROR_OVERLOADED:
            return APIError(
                503,
                str(err),
                type="service_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
    return APIError(503, f"engine error: {err}", type="service_unavailable")


async def open_generations(
    client: AsyncClient, requests: Sequence[dict[str, Any]], prompt_param: str
) -> list[Generation]:
    """Starts every request and waits for each one's first delta; if any is refused, the
    others are aborted and the first refusal is raised as an APIError."""
    streams = [client.stream(r.get("prompt"), r["params"], messages=r.get("messages"))
               for r in requests]  # fmt: skip
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failure = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failure is not None:
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()  # type: ignore[attr-defined]
        if isinstance(failure, EngineError):
            raise api_error(failure, prompt_param)
        if isinstance(failure, ValueError):  # the SDK could not even send it
            raise APIError(400, str(failure), param=prompt_param)
        if isinstance(failure, StopAsyncIteration):
            raise APIError(503, "the engine ended a request without output",
                           type="service_unavailable")  # fmt: skip
        raise failure
    return [Generation(s, f) for s, f in zip(streams, firsts)]  # type: ignore[arg-type]


async def _merged(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, OutputDelta]]:
    """The deltas of every generation as they come, tagged with the generation's index."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, OutputDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for d in g.deltas():
                await queue.put((i, d))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    live = len(gens)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _error_event(err: Exception) -> bytes:
    e = api_error(err, "prompt") if isinstance(err, EngineError) else APIError(500, str(err))
    return sse_event({"error": {"message": e.message, "type": e.type, "param": e.param,
                                "code": e.status}})  # fmt: skip


async def stream_completions(
    gens: list[Generation],
    model: str,
    token_text: Callable[[int], str],
    include_usage: bool,
    on_finished: Callable[[RequestOutput], None],
) -> AsyncIterator[bytes]:
    """/v1/completions as server-sent events (one chunk per delta, then usage, [DONE])."""
    rid, created = responses.new_id("cmpl"), responses.now()
    outs = [RequestOutput(request_id=g.first.request_id) for g in gens]
    want_logprobs = any(g.first.logprobs for g in gens)
    try:
        async for i, d in _merged(gens):
            out = outs[i]
            offset = len(out.text)
            out.apply(d)
            if not (d.text or d.finish_reason or d.token_ids):
                continue
            choice: dict[str, Any] = {
                "index": i,
                "text": d.text,
                "logprobs": None,
                "finish_reason": responses.finish_reason(d.finish_reason),
            }
            if want_logprobs and d.logprobs:
                choice["logprobs"] = responses.completion_logprobs(
                    d.token_ids, d.logprobs, token_text, offset
                )
            yield sse_event({"id": rid, "object": "text_completion", "created": created,
                             "model": model, "choices": [choice]})  # fmt: skip
            if d.finish_reason:
                on_finished(out)
    except EngineError as e:
        yield _error_event(e)
    finally:
        for g in gens:
            await g.close()
    if include_usage:
        usage = responses.usage(
            sum(len(o.prompt_token_ids) for o in outs), sum(len(o.token_ids) for o in outs)
        )
        yield sse_event({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [], "usage": usage})  # fmt: skip
    yield SSE_DONE


async def stream_chat(
    gen: Generation,
    model: str,
    token_text: Callable[[int], str],
    include_usage: bool,
    on_finished: Callable[[RequestOutput], None],
) -> AsyncIterator[bytes]:
    """/v1/chat/completions as server-sent events: a role chunk, content chunks, a chunk
    with the finish reason, usage when asked for, then [DONE]."""
    rid, created = responses.new_id("chatcmpl"), responses.now()
    out = RequestOutput(request_id=gen.first.request_id)

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": model, "choices": [choice]})  # fmt: skip

    yield chunk({"role": "assistant", "content": ""}, None)
    try:
        async for d in gen.deltas():
            out.apply(d)
            if not (d.text or d.finish_reason or d.token_ids):
                continue
            lps = (
                responses.chat_logprobs(d.token_ids, d.logprobs, token_text) if d.logprobs else None
            )
            delta = {"content": d.text} if d.text else {}
            yield chunk(delta, responses.finish_reason(d.finish_reason), lps)
            if d.finish_reason:
                on_finished(out)
    except EngineError as e:
        yield _error_event(e)
    finally:
        await gen.close()
    if include_usage:
        usage = responses.usage(len(out.prompt_token_ids), len(out.token_ids))
        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": [], "usage": usage})  # fmt: skip
    yield SSE_DONE
