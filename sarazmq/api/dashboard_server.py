"""The dashboard without the OpenAI API: `replay --dashboard` serves /dashboard from the
replaying process while a trace runs, watching the deployment it replays against.

uvicorn runs on a thread of its own with its own event loop (the replay's loop is busy
sending requests, and a `--compare` run replays several deployments one after the
other: `attach` switches the page to the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette

from sarazmq.api.dashboard import DashboardFeed, DashboardHub, DashboardSettings
from sarazmq.api.pages import dashboard_data_routes, page_routes
from sarazmq.client import AsyncClient, EngineError

#: seconds `start` waits for the socket to accept connections
START_TIMEOUT_S = 30.0
#: the page has no key here: it is served on the loopback interface only
HOST = "127.0.0.1"


class DashboardServer:
    """/dashboard on 127.0.0.1:`port`, for one deployment at a time. Use as a context
    manager (or start/stop); the feed takes finished requests' latencies
    (`feed.observe_request`)."""

    def __init__(
        self, port: int, model_name: str, settings: DashboardSettings | None = None
    ) -> None:
        self.port = port
        self.feed = DashboardFeed(model_name, settings, api=False)
        self._endpoint: str | None = None
        self._client: AsyncClient | None = None
        self._client_endpoint: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/dashboard"

    def attach(self, endpoint: str, label: str = "") -> None:
        """Watch the deployment at `endpoint` from now on (the page starts over)."""
        self.feed.reset(label)
        self._endpoint = endpoint

    async def _stats(self, iterations_from: int) -> Mapping[str, Any]:
        endpoint = self._endpoint
        if endpoint is None:
            raise EngineError("no deployment is attached yet")
        if self._client is None or self._client_endpoint != endpoint:
            if self._client is not None:
                await self._client.close()
            self._client = AsyncClient(endpoint, heartbeat_timeout=30.0)
            self._client_endpoint = endpoint
        return await self._client.stats(timeout=5.0, iterations_from=iterations_from)

    def _app(self, hub: DashboardHub) -> Starlette:
        return Starlette(routes=[*dashboard_data_routes(hub, lambda h: h), *page_routes()])

    def _run(self, started: threading.Event) -> None:
        async def main() -> None:
            hub = DashboardHub(self.feed, self._stats)
            config = uvicorn.Config(
                self._app(hub),
                host=HOST,
                port=self.port,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
            self._server = uvicorn.Server(config)
            # not the main thread: the replay handles signals (as serve_http's caller does)
            self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
            task = asyncio.create_task(self._server.serve())
            while not self._server.started and not task.done():
                await asyncio.sleep(0.02)
            started.set()
            try:
                await task
            finally:
                await hub.close()
                if self._client is not None:
                    await self._client.close()

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
        finally:
            started.set()

    def start(self) -> DashboardServer:
        """Starts serving; raises OSError (say, the port is taken) if it cannot."""
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(START_TIMEOUT_S)
        if self._server is None or not self._server.started:
            self.stop()
            reason = self._error or "it did not start in time"
            raise OSError(f"the dashboard could not listen on {HOST}:{self.port}: {reason}")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
