"""The browser pages the HTTP server serves: /dashboard (the scheduler at work) and
/chat, with their static assets from the package (no CDN: they work offline).

The pages themselves hold no data and are served to anyone, like a login page; every
request they make for data (/dashboard/state, /dashboard/events, /v1/...) carries the
API's bearer key, which the page asks for when the server answers 401.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from sarazmq.api.dashboard import DashboardHub
from sarazmq.api.encoding import json_response, sse_event

STATIC_DIR = Path(__file__).parent / "static"

Handler = Callable[[Request], Awaitable[Response]]


def _page(name: str) -> Handler:
    path = STATIC_DIR / name

    async def page(request: Request) -> Response:
        return FileResponse(path, media_type="text/html", headers={"Cache-Control": "no-cache"})

    return page


def page_routes() -> list[BaseRoute]:
    """/dashboard, /chat and /static/*: the pages and their scripts and styles."""
    return [
        Route("/dashboard", _page("dashboard.html"), methods=["GET"]),
        Route("/chat", _page("chat.html"), methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ]


def dashboard_data_routes(hub: DashboardHub, wrap: Callable[[Handler], Handler]) -> list[Route]:
    """/dashboard/state (one snapshot, JSON) and /dashboard/events (a snapshot per poll,
    server-sent events); `wrap` adds the server's error handling and auth."""

    async def state(request: Request) -> Response:
        if hub.num_viewers == 0:  # nobody is polling: ask the engine now
            await hub.poll_once()
        return json_response(hub.feed.snapshot())

    async def events(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            # aclosing: a viewer that leaves unsubscribes at once (the poll stops with
            # the last one), not when the generator is collected
            async with contextlib.aclosing(hub.subscribe()) as snapshots:
                async for snapshot in snapshots:
                    yield sse_event(snapshot)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    return [
        Route("/dashboard/state", wrap(state), methods=["GET"]),
        Route("/dashboard/events", wrap(events), methods=["GET"]),
    ]
