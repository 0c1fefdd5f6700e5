"""Pipeline parallelism on the worker side: ranks, stages and the activation links.

Placement: a deployment of tp x pp worker ranks; global rank = stage * tp + tp_rank, so
a stage's tensor-parallel group is the contiguous ranks [stage * tp, (stage + 1) * tp).
Stage s's tp rank r sends its activations to stage s+1's tp rank r (after each stage's
all-reduces every tp rank holds the same activations, so the copies are redundant but
every rank gets its input without a broadcast). The driver, the rank that samples and
answers the scheduler, is tp rank 0 of the last stage.

Per plan, every stage passes on, with the activations, a small float64 [2, pp] tensor of
timings: row 0 each stage's busy seconds, row 1 its seconds waiting for its input. The
driver puts them into the `StepResult` (`stage_busy_s`, `stage_wait_s`), which is how
the scheduler measures pipeline bubbles without another socket.

Links: `DistLink` (torch.distributed point-to-point: gloo on CPU, NCCL on CUDA) between
processes, `LocalLink` (a queue) between stages in one process.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Placement:
    """Where one worker rank sits: its tensor-parallel rank inside its pipeline stage."""

    rank: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} and pp_size={self.pp_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, {self.world_size}) (tp x pp)")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Samples and answers the scheduler: tp rank 0 of the last stage."""
        return self.tp_rank == 0 and self.is_last_stage

    def stage_ranks(self, stage: int) -> list[int]:
        """The global ranks of pipeline stage `stage` (its tensor-parallel group)."""
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    @property
    def prev_rank(self) -> int | None:
        """The rank this one receives activations from (None on the first stage)."""
        return None if self.is_first_stage else self.rank - self.tp_size

    @property
    def next_rank(self) -> int | None:
        """The rank this one sends activations to (None on the last stage)."""
        return None if self.is_last_stage else self.rank + self.tp_size


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The global rank of the driver (tp rank 0 of the last stage)."""
    return (pp_size - 1) * tp_size


def new_timings(pp_size: int, device: torch.device) -> torch.Tensor:
    """The zeroed [2, pp] float64 timings the first stage starts a plan's record with."""
    return torch.zeros(2, pp_size, dtype=torch.float64, device=device)


class ActivationLink(abc.ABC):
    """Hands a stage's activations and the plan's timings to the next stage, in plan
    order (every stage runs the plans in the order the scheduler sent them)."""

    @abc.abstractmethod
    def send(self, activations: torch.Tensor, timings: torch.Tensor) -> None:
        """Sends to the next stage; may return before the transfer completes."""

    @abc.abstractmethod
    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, timings_shape: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's next (activations, timings); blocks until they arrive."""

    @abc.abstractmethod
    def close(self) -> None:
        """Waits for sends in progress."""


class DistLink(ActivationLink):
    """torch.distributed point-to-point to fixed peer ranks of the default group.

    Sends are asynchronous (isend), one in progress at most: a stage can run its next
    plan while the next stage still computes, and the sent tensors stay referenced
    until the transfer is done.
    """

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device):
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: list[Any] = []
        self._pending_tensors: tuple[torch.Tensor, ...] = ()

    def send(self, activations: torch.Tensor, timings: torch.Tensor) -> None:
        import torch.distributed as dist

        if self.next_rank is None:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        self.close()
        acts = activations.contiguous()
        self._pending = [
            dist.isend(acts, dst=self.next_rank),
            dist.isend(timings, dst=self.next_rank),
        ]
        self._pending_tensors = (acts, timings)

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, timings_shape: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        if self.prev_rank is None:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        acts = torch.empty(shape, dtype=dtype, device=self.device)
        timings = torch.empty(timings_shape, dtype=torch.float64, device=self.device)
        dist.recv(acts, src=self.prev_rank)
        dist.recv(timings, src=self.prev_rank)
        return acts, timings

    def close(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []
        self._pending_tensors = ()


class LocalLink(ActivationLink):
    """Between two stages in one process: a FIFO the sender fills and the receiver
    empties (the receiver must run after the sender, e.g. `InProcessPipeline`)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def send(self, activations: torch.Tensor, timings: torch.Tensor) -> None:
        self._queue.append((activations, timings.clone()))

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, timings_shape: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._queue:
            raise RuntimeError("no activations from the previous stage (plans out of order?)")
        acts, timings = self._queue.popleft()
        if tuple(acts.shape) != tuple(shape) or tuple(timings.shape) != tuple(timings_shape):
            raise RuntimeError(
                f"activations {tuple(acts.shape)} / timings {tuple(timings.shape)} from the "
                f"previous stage, expected {tuple(shape)} / {tuple(timings_shape)}"
            )
        return acts.to(dtype), timings

    def close(self) -> None:
        """Nothing in progress: a local send is done when it returns."""

    def __len__(self) -> int:
        return len(self._queue)


@dataclass
class StageLinks:
    """A worker's pipeline position and its links: `recv_from` the previous stage (None
    on the first), `send_to` the next (None on the last)."""

    placement: Placement
    recv_from: ActivationLink | None = None
    send_to: ActivationLink | None = None

    def __post_init__(self) -> None:
        p = self.placement
        if (self.recv_from is None) != p.is_first_stage:
            raise ValueError(
                f"stage {p.pp_rank}: a link from the previous stage is needed "
                "exactly when the stage is not the first"
            )
        if (self.send_to is None) != p.is_last_stage:
            raise ValueError(
                f"stage {p.pp_rank}: a link to the next stage is needed "
                "exactly when the stage is not the last"
            )
