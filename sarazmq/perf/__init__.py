"""Iteration cost and latency models: what one hybrid iteration costs and how long it takes.

- `shape`: `IterationShape`, the features of one iteration (from a plan or from lengths).
- `model`: the `LatencyModel` protocol.
- `cost`: `ModelCost`, an iteration's FLOPs and bytes for a model (MFU, MBU, rooflines).
- `architectures`: named model architectures and GPUs.
- `linear`: `PiecewiseLinearModel` (a knee for the linear layers), its non-negative fit
  `fit_latency_model` and `prediction_error`.
- `gpu`: `GpuProfileModel` (Vidur's A100/H100 tables) and `RooflineModel` (any GPU).
- `cpu_overhead`: the CPU's per-iteration time (Vidur's measured vLLM overheads).
- `pipeline`: `PipelineLatency`, per-stage times of a pipeline-parallel deployment and the
  activation transfer between stages.
- `load`: `load_latency_model`, the one entry point for a simulator: a profile or a GPU
  (with tp and pp).
- `machine`, `shapes_runner`, `profile` (import torch): the probe of this machine, timing
  exact shapes on a `ModelRunner`, and `sarazmq profile`'s grid, fit and report.
"""

from sarazmq.perf.cost import ModelCost
from sarazmq.perf.linear import (
    ErrorReport,
    PiecewiseLinearModel,
    fit_latency_model,
    prediction_error,
)
from sarazmq.perf.load import load_latency_model
from sarazmq.perf.model import LatencyModel
from sarazmq.perf.shape import IterationShape

__all__ = [
    "ErrorReport",
    "IterationShape",
    "LatencyModel",
    "ModelCost",
    "PiecewiseLinearModel",
    "fit_latency_model",
    "load_latency_model",
    "prediction_error",
]
