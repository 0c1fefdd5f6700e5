"""Client SDK for a sarazmq deployment: `AsyncClient` and its synchronous twin `Client`.

One DEALER connection carries any number of concurrent requests; see `AsyncClient`.
"""

from sarazmq.client.async_client import AsyncClient
from sarazmq.client.errors import EngineError, HealthReport, RequestError
from sarazmq.client.replicas import replica_summaries
from sarazmq.client.sync_client import Client

__all__ = [
    "AsyncClient",
    "Client",
    "EngineError",
    "HealthReport",
    "RequestError",
    "replica_summaries",
]
