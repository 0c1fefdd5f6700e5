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
- `service.SchedulerService`: what the process does around it (rejections, routing
  deltas to detokenizer shards, deferring control while a plan is in flight).

The process loop is `sarazmq.procs.scheduler`.
"""

from sarazmq.scheduler.block_manager import BlockAllocationError, BlockManager
from sarazmq.scheduler.build import build_scheduler
from sarazmq.scheduler.policies import POLICY_CLASSES, Policy, make_policy
from sarazmq.scheduler.request import Request, RequestStatus
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.service import SchedulerActions, SchedulerService

__all__ = [
    "POLICY_CLASSES",
    "BlockAllocationError",
    "BlockManager",
    "IterationRecord",
    "Policy",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerActions",
    "SchedulerService",
    "SchedulerStats",
    "build_scheduler",
    "make_policy",
]
