"""The scheduler process's room: pure, socket-free scheduling.

- `request.Request`: one request's scheduling state.
- `block_manager.BlockManager`: paged KV block accounting, with automatic prefix caching
  (`prefix_cache`: the chained SHA-256 block keys and the hit counters;
  docs/PREFIX_CACHING.md).
- `policies`: Sarathi-Serve's stall-free hybrid batches and its four baselines.
- `scheduler.Scheduler`: requests, the pool and the policy; builds each iteration's
  `BatchPlan` diff (`build_scheduler` is the one way to build it from a config).
- `inflight`: the plans in flight (up to one per pipeline stage) and the view of the
  running requests the policies get while some are.
- `stats`: the counters and per-iteration records it reports (`bubble_fraction`).
- `shape`: `IterationShape`, what an iteration's time depends on.
- `latency`: the `LatencyModel` interface and the piecewise-linear model; `latency_fit`
  fits it (numpy); `online.OnlineLatencyModel` refits it from the iterations that run;
  `adaptive`: the token budget of a TBT target built on it.
- `service.SchedulerService`: what the process does around it (rejections, routing
  deltas to detokenizer shards, deferring control while a plan is in flight).

Other packages import the names below from `sarazmq.scheduler`, not its modules. The
names whose modules load numpy (the fit and the online model) are imported on first
use, so `import sarazmq.scheduler` loads no numerical library. The process loop is
`sarazmq.procs.scheduler`.
"""

from __future__ import annotations

import importlib
from typing import Any

from sarazmq.scheduler.block_manager import BlockAllocationError, BlockManager
from sarazmq.scheduler.build import build_scheduler
from sarazmq.scheduler.latency import (
    KIND,
    LatencyModel,
    PiecewiseLinearModel,
    profile_model,
)
from sarazmq.scheduler.policies import POLICY_CLASSES, Policy, make_policy
from sarazmq.scheduler.prefix_cache import ROOT_KEY, sha256_block_key
from sarazmq.scheduler.request import Request, RequestStatus
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.service import SchedulerActions, SchedulerService, configure_scheduler_gc
from sarazmq.scheduler.shape import (
    IterationShape,
    chunk_attention_pairs,
    shape_of,
    shape_of_fields,
    shape_of_plan,
)
from sarazmq.scheduler.stats import (
    IterationRecord,
    SchedulerStats,
    active_seconds,
    bubble_fraction,
    bubble_fraction_of,
)

#: public names whose modules import numpy: name -> module, imported on first access
_NUMPY_EXPORTS = {
    "fit_latency_model": "sarazmq.scheduler.latency_fit",
    "nnls": "sarazmq.scheduler.latency_fit",
    "predict_many": "sarazmq.scheduler.latency_fit",
    "OnlineLatencyModel": "sarazmq.scheduler.online",
}


def __getattr__(name: str) -> Any:
    module = _NUMPY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sarazmq.scheduler' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "KIND",
    "POLICY_CLASSES",
    "ROOT_KEY",
    "BlockAllocationError",
    "BlockManager",
    "IterationRecord",
    "IterationShape",
    "LatencyModel",
    "OnlineLatencyModel",
    "PiecewiseLinearModel",
    "Policy",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerActions",
    "SchedulerService",
    "SchedulerStats",
    "active_seconds",
    "bubble_fraction",
    "bubble_fraction_of",
    "build_scheduler",
    "chunk_attention_pairs",
    "configure_scheduler_gc",
    "fit_latency_model",
    "make_policy",
    "nnls",
    "predict_many",
    "profile_model",
    "sha256_block_key",
    "shape_of",
    "shape_of_fields",
    "shape_of_plan",
]
