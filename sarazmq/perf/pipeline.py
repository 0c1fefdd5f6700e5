"""Pipeline-parallel iteration time: what each stage spends on a micro-batch, and the
activation transfer between stages.

With `pp` stages the model's decoder layers are split into `pp` contiguous groups
(`split_layers`: as even as possible, the first stages take the remainder). A micro-batch
(one plan) runs on stage 0, its hidden states (num_tokens x hidden_size x elem bytes) go
to stage 1 over the inter-stage link, and so on; the last stage samples. A stage's time:

    stage s = layers_s x (its layers / all layers)
              + first_s (stage 0 only: embedding, the CPU's scheduling and input prep)
              + last_s  (last stage only: final norm, LM head, sampling, output work)

from a base model's `parts(shape)` (`GpuProfileModel`, `RooflineModel`). A base model
without `parts` (a measured profile) has its whole predicted time split by layers.
Tensor parallelism stays inside each stage (the base model's `tp`: its all-reduces are
part of `layers_s`).

The link: `transfer_s = link_latency_s + bytes / link_bandwidth`. The default is one
200 Gb/s InfiniBand HDR port per GPU (25 GB/s, as on a DGX A100: stages on two nodes,
each tensor-parallel rank sending its copy of the hidden states to its peer in parallel);
within a node pass NVLink's bandwidth (the `Gpu.link_bandwidth`) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sarazmq.scheduler import IterationShape, LatencyModel

#: bytes/s between consecutive stages by default: a 200 Gb/s InfiniBand HDR port per GPU
DEFAULT_PP_LINK_BANDWIDTH = 25e9
#: the fixed latency of one inter-stage send (a small RDMA message across nodes)
DEFAULT_PP_LINK_LATENCY_S = 10e-6


@dataclass(frozen=True)
class IterationParts:
    """One iteration's time by where a pipeline runs it (seconds).

    first_s: before the first decoder layer (embedding, CPU scheduling and input prep).
    layers_s: all decoder layers together (attention, linear layers, TP all-reduces).
    last_s: after the last decoder layer (LM head, sampling, CPU output processing).
    """

    first_s: float = 0.0
    layers_s: float = 0.0
    last_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.first_s + self.layers_s + self.last_s


@runtime_checkable
class PartsModel(Protocol):
    """A latency model that can say where its time goes (`IterationParts`)."""

    def predict(self, shape: IterationShape) -> float: ...

    def parts(self, shape: IterationShape) -> IterationParts: ...


def split_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """The decoder layers of each of `pp` stages: contiguous, as even as possible, the first
    `num_layers % pp` stages one more. ValueError when a stage would get none."""
    if pp < 1:
        raise ValueError(f"pipeline parallel size {pp} must be >= 1")
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot be split into {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


@dataclass(frozen=True)
class PipelineLatency:
    """Per-stage times of a `pp`-stage pipeline over a single-pipeline `base` model (see
    the module docstring). `predict` is one micro-batch's latency through an empty
    pipeline (every stage plus the transfers), so the object is a `LatencyModel` too.

    base: the whole model's iteration time at the deployment's TP degree.
    num_layers / hidden_size: the architecture's (layer split; bytes sent per token).
    elem: bytes per activation element (2: bf16).
    link_bandwidth: bytes/s between consecutive stages; link_latency_s: per send.
    """

    base: LatencyModel
    pp: int
    num_layers: int
    hidden_size: int
    elem: int = 2
    link_bandwidth: float = DEFAULT_PP_LINK_BANDWIDTH
    link_latency_s: float = DEFAULT_PP_LINK_LATENCY_S

    def __post_init__(self) -> None:
        split_layers(self.num_layers, self.pp)  # raises on a bad split
        if self.hidden_size < 1 or self.elem < 1:
            raise ValueError(f"hidden_size={self.hidden_size} and elem={self.elem} must be >= 1")
        if not self.link_bandwidth > 0:
            raise ValueError(f"link_bandwidth={self.link_bandwidth} must be > 0 (bytes/s)")
        if not self.link_latency_s >= 0:
            raise ValueError(f"link_latency_s={self.link_latency_s} must be >= 0")

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return split_layers(self.num_layers, self.pp)

    def stage_times(self, shape: IterationShape) -> tuple[float, ...]:
        """Seconds each stage computes this micro-batch (pp = 1: the base's prediction)."""
        if self.pp == 1:
            return (self.base.predict(shape),)
        if isinstance(self.base, PartsModel):
            p = self.base.parts(shape)
        else:
            p = IterationParts(layers_s=self.base.predict(shape))
        out = [p.layers_s * n / self.num_layers for n in self.stage_layers]
        out[0] += p.first_s
        out[-1] += p.last_s
        return tuple(out)

    def transfer_s(self, shape: IterationShape) -> float:
        """Seconds to send this micro-batch's hidden states from one stage to the next."""
        if self.pp == 1 or shape.num_tokens == 0:
            return 0.0
        nbytes = shape.num_tokens * self.hidden_size * self.elem
        return self.link_latency_s + nbytes / self.link_bandwidth

    def predict(self, shape: IterationShape) -> float:
        """One micro-batch alone through the pipeline: every stage and transfer."""
        return sum(self.stage_times(shape)) + (self.pp - 1) * self.transfer_s(shape)

    def describe(self) -> dict[str, Any]:
        """The pipeline's settings (for a run's summary)."""
        return {
            "pp": self.pp,
            "stage_layers": list(self.stage_layers),
            "link_bandwidth": self.link_bandwidth,
            "link_latency_s": self.link_latency_s,
            "split": "parts" if isinstance(self.base, PartsModel) else "by layers",
        }
