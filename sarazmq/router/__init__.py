"""Routing requests to engine instances (data-parallel replicas; the phases of a
disaggregated deployment), socket-free: the frontend and the fleet simulator use it alike.

- `table.InstanceTable`: each instance's role, liveness and reported load.
- `prefix_index.PrefixIndex`: which prompt prefix blocks were recently sent where.
- `router.Router`: the policies (`round-robin`, `least-load`, `cache-aware`) over both.
"""

from sarazmq.router.prefix_index import PrefixIndex
from sarazmq.router.router import (
    MAX_ROUTE_BLOCKS,
    ROUTER_POLICIES,
    NoInstanceError,
    Router,
    RouterConfig,
    build_router,
    prompt_block_keys,
    routing_policy,
)
from sarazmq.router.table import KV_FULL, ROLES, InstanceState, InstanceTable

__all__ = [
    "KV_FULL",
    "MAX_ROUTE_BLOCKS",
    "ROLES",
    "ROUTER_POLICIES",
    "InstanceState",
    "InstanceTable",
    "NoInstanceError",
    "PrefixIndex",
    "Router",
    "RouterConfig",
    "build_router",
    "prompt_block_keys",
    "routing_policy",
]
