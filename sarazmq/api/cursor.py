"""Which scheduler iteration records a poller has already seen.

The scheduler keeps its recent iteration records and answers `stats(iterations_from=S)`
with those of step >= S. A poller (the /metrics histogram, the dashboard) keeps one
cursor per engine instance: with data-parallel replicas step numbers are per replica
("instance" in each record, one query asks every replica from the same step), and a
replica that restarted numbers its steps from 1 again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class IterationCursor:
    """Per instance, the next step not yet taken.

    backlog: on the first stats seen (and after a replica restarts), how many of its
    latest iterations are still to be taken (0: count from now on, as /metrics does).
    """

    def __init__(self, backlog: int = 0) -> None:
        if backlog < 0:
            raise ValueError(f"backlog={backlog} must be >= 0")
        self.backlog = backlog
        self._next: dict[int, int] = {}
        self._started = False

    @property
    def next_step(self) -> int:
        """The step to ask the engine for (`iterations_from`); -1 before any stats."""
        return min(self._next.values()) if self._next else -1

    def take(self, stats: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The records in `stats["iterations"]` not taken before, in order; moves on."""
        new: list[dict[str, Any]] = []
        floor = self.next_step
        for it in stats.get("iterations", []):
            instance, step = int(it.get("instance", 0)), int(it.get("step", 0))
            if step < self._next.get(instance, floor):
                continue
            new.append(it)
            self._next[instance] = step + 1
        for r in stats.get("replicas") or [{"instance": 0, **stats}]:
            instance, done = int(r["instance"]), int(r.get("num_iterations", 0))
            # first stats: start `backlog` steps back; a replica that restarted numbers
            # its steps from 1 again (and has done fewer than our cursor)
            if not self._started or self._next.get(instance, 0) > done + 1:
                self._next[instance] = max(1, done + 1 - self.backlog)
        self._started = True
        return new
