"""Pure, socket-free scheduling: request state, KV block accounting, batch policies."""

from sarazmq.scheduler.block_manager import BlockAllocationError, BlockManager
from sarazmq.scheduler.policies import POLICY_CLASSES, Policy, make_policy
from sarazmq.scheduler.request import Request, RequestDelta, RequestStatus
from sarazmq.scheduler.scheduler import IterationRecord, Scheduler, SchedulerStats

__all__ = [
    "POLICY_CLASSES",
    "BlockAllocationError",
    "BlockManager",
    "IterationRecord",
    "Policy",
    "Request",
    "RequestDelta",
    "RequestStatus",
    "Scheduler",
    "SchedulerStats",
    "make_policy",
]
