"""Iteration cost and latency models: what one hybrid iteration costs and how long it takes.

The offline modelling package (profiles, simulators, sweeps); the serving runtime never
imports it. The iteration shape, the `LatencyModel` interface and the piecewise-linear
model it fits live with the scheduler (`sarazmq.scheduler`), which needs them online.
Import the modules themselves: this package loads nothing on import.

- `cost`: `ModelCost`, an iteration's FLOPs and bytes for a model (MFU, MBU, rooflines).
- `architectures`: named model architectures and GPUs.
- `accuracy`: `prediction_error`, how far a model is from measured iterations.
- `gpu`: `GpuProfileModel` (Vidur's A100/H100 tables) and `RooflineModel` (any GPU).
- `cpu_overhead`: the CPU's per-iteration time (Vidur's measured vLLM overheads).
- `pipeline`: `PipelineLatency`, per-stage times of a pipeline-parallel deployment and the
  activation transfer between stages.
- `load`: `load_latency_model`, the one entry point for a simulator: a profile or a GPU
  (with tp and pp).
- `machine`, `shapes_runner`, `profile` (import torch): the probe of this machine, timing
  exact shapes on a `ModelRunner`, and `sarazmq profile`'s grid, fit and report.
"""
