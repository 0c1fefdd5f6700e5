"""The worker process's logic (socket-free): one `WorkerInbound` message in, a reply out."""

from __future__ import annotations

from sarazmq.protocol.worker import BatchPlan, Shutdown, StepResult, WorkerInbound
from sarazmq.worker.model_runner import ModelRunner


class WorkerService:
    """What one worker rank does with each message from the scheduler.

    Every rank runs every plan on its own shard; only the driver (tp rank 0 of the last
    pipeline stage; rank 0 without pipeline) answers, since only it samples. `stopped`
    turns True on `Shutdown`.
    """

    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self.stopped = False

    @property
    def is_driver(self) -> bool:
        stage = self.runner.stage
        return stage.placement.is_driver if stage is not None else self.rank == 0

    def on_message(self, msg: WorkerInbound) -> StepResult | None:
        """Runs a plan (the driver's result, None on other ranks) or notes a Shutdown."""
        if isinstance(msg, Shutdown):
            self.stopped = True
            return None
        if not isinstance(msg, BatchPlan):
            raise TypeError(f"worker got an unexpected message {type(msg).__name__}")
        result = self.runner.execute(msg)
        return result if self.is_driver else None
