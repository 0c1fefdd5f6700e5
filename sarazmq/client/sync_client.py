"""`Client`: the synchronous twin of `AsyncClient`, on a private event-loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sarazmq.client.async_client import AsyncClient, Prompt
from sarazmq.client.errors import HealthReport
from sarazmq.outputs import RequestOutput
from sarazmq.protocol.client import OutputDelta
from sarazmq.sampling_params import SamplingParams

_STREAM_END = object()


class Client:
    """Synchronous client with the same surface as `AsyncClient`; thread-safe.

    It runs an `AsyncClient` on a private event-loop thread, so many threads may
    stream concurrently over the one connection.
    """

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="sarazmq-client"
        )
        self._thread.start()
        self._async = AsyncClient(endpoint, **kwargs)
        self.endpoint = endpoint

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self, prompt: Prompt | None = None, params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput:
        return self._call(self._async.generate(prompt, params, **kwargs))

    def stream(
        self, prompt: Prompt | None = None, params: SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[OutputDelta]:
        """Yields deltas as they arrive; closing the generator early aborts the request."""
        items: queue.Queue[Any] = queue.Queue()
        agen = self._async.stream(prompt, params, **kwargs)

        async def pump() -> None:
            try:
                async for delta in agen:
                    items.put(delta)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                items.put(e)
            finally:
                items.put(_STREAM_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = items.get()
                if item is _STREAM_END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        stream: bool = False,
        **kwargs: Any,
    ) -> Any:
        if stream:
            return self.stream(None, params, messages=messages, **kwargs)
        return self.generate(None, params, messages=messages, **kwargs)

    def abort(self, request_id: str) -> None:
        self._call(self._async.abort(request_id))

    def stats(self, timeout: float = 10.0, iterations_from: int = -1) -> dict[str, Any]:
        return self._call(self._async.stats(timeout, iterations_from))

    def reset_prefix_cache(self, timeout: float = 10.0) -> None:
        """See `AsyncClient.reset_prefix_cache`."""
        self._call(self._async.reset_prefix_cache(timeout))

    def health(self, timeout: float = 10.0) -> HealthReport:
        """See `AsyncClient.health`."""
        return self._call(self._async.health(timeout))

    def new_request_id(self) -> str:
        return self._async.new_request_id()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
