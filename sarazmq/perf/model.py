"""The latency model interface: how long one iteration of a given shape takes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sarazmq.perf.shape import IterationShape


@runtime_checkable
class LatencyModel(Protocol):
    """Predicts the wall time (seconds) of one iteration from its shape."""

    def predict(self, shape: IterationShape) -> float: ...
