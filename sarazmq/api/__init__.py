"""The OpenAI-compatible HTTP server (a client of the deployment's frontend).

- `app.OpenAIServer`: the routes (/v1/completions, /v1/chat/completions, /v1/models,
  /health, /version, /metrics, /dashboard, /chat), auth and limits.
- `schemas`: OpenAI request bodies and their translation to `SamplingParams`.
- `streams`: opening, collecting and streaming (SSE) generations.
- `responses`, `encoding`, `errors`, `metrics`: bodies, JSON, OpenAI errors, Prometheus.
- `dashboard`, `cursor`, `pages`: the live dashboard's data (socket-free feed, the poller
  shared by its viewers) and the pages served from `static/`.
- `dashboard_server`: the dashboard alone, for `replay --dashboard`.
- `server`: running it on uvicorn (the deployment's `api` process, or `sarazmq api`).
"""

from sarazmq.api.app import APIConfig, OpenAIServer
from sarazmq.api.dashboard_server import DashboardServer
from sarazmq.api.server import HTTPBind, serve_http

__all__ = [
    "APIConfig",
    "DashboardServer",
    "HTTPBind",
    "OpenAIServer",
    "serve_http",
]
