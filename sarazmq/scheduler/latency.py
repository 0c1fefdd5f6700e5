"""Iteration latency models the scheduler uses: the interface and the piecewise-linear model.

time = c0
     + c_tok * max(num_tokens, knee)       linear layers: below the knee a step is bound by
                                           reading the weights (flat), above it by FLOPs
     + c_pairs * prefill_attention_pairs   prefill attention (causal (query, key) pairs)
     + c_ctx * decode_context_tokens       decode attention (KV positions read)
     + c_seq * num_seqs                    per-sequence work (metadata, gathers, sampling)
     + c_sampled * num_sampled             LM head rows and sampling

Predicting is plain arithmetic; fitting (`latency_fit`, numpy) is imported only where a
fit runs, so the serving scheduler loads no numerical library unless its TBT budget
learns a model. The offline models (Vidur's GPU tables, rooflines, pipelines) live in
`sarazmq.perf` and satisfy the same `LatencyModel` interface.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from sarazmq.scheduler.shape import IterationShape

KIND = "piecewise_linear"
COEFFICIENTS = ("c0", "c_tok", "c_pairs", "c_ctx", "c_seq", "c_sampled")


@runtime_checkable
class LatencyModel(Protocol):
    """Predicts the wall time (seconds) of one iteration from its shape."""

    def predict(self, shape: IterationShape) -> float: ...


@dataclass(frozen=True)
class PiecewiseLinearModel:
    """A LatencyModel: seconds of one iteration from its shape (see the module docstring)."""

    knee: int = 1
    c0: float = 0.0
    c_tok: float = 0.0
    c_pairs: float = 0.0
    c_ctx: float = 0.0
    c_seq: float = 0.0
    c_sampled: float = 0.0

    def __post_init__(self) -> None:
        if self.knee < 0:
            raise ValueError(f"knee={self.knee} must be >= 0")
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be finite and >= 0")

    def predict(self, shape: IterationShape) -> float:
        """Seconds; plain arithmetic (cheap enough for a scheduler's per-candidate calls).
        An empty shape (no tokens) costs nothing."""
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        if tokens == 0:
            return 0.0
        return (
            self.c0
            + self.c_tok * (tokens if tokens > self.knee else self.knee)
            + self.c_pairs * shape.prefill_attention_pairs
            + self.c_ctx * shape.decode_context_tokens
            + self.c_seq * (shape.num_prefill_seqs + shape.num_decode_seqs)
            + self.c_sampled * shape.num_sampled
        )

    def coefficients(self) -> tuple[float, ...]:
        """The coefficients in `COEFFICIENTS` order."""
        return tuple(float(getattr(self, n)) for n in COEFFICIENTS)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PiecewiseLinearModel:
        """The model of `to_dict`'s output; ValueError naming what is missing or wrong."""
        if data.get("kind") != KIND:
            raise ValueError(f"not a {KIND} model (kind={data.get('kind')!r})")
        missing = [k for k in ("knee", *COEFFICIENTS) if k not in data]
        if missing:
            raise ValueError(f"{KIND} model lacks {', '.join(missing)}")
        return cls(knee=int(data["knee"]), **{k: float(data[k]) for k in COEFFICIENTS})


def read_profile(path: str) -> dict[str, Any]:
    """A profile JSON (`sarazmq profile --output`), or a bare model dict; ValueError naming
    --profile when it cannot be read or is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile {path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--profile {path}: not a profile (a JSON object)")
    return data


def profile_model(path: str) -> tuple[PiecewiseLinearModel, dict[str, Any]]:
    """The model a profile JSON holds and the file's whole content; ValueError naming
    --profile when it has none or a malformed one."""
    data = read_profile(path)
    model_dict = data.get("model", data)
    if not isinstance(model_dict, dict) or model_dict.get("kind") != KIND:
        raise ValueError(f"--profile {path}: no {KIND} model in it")
    try:
        return PiecewiseLinearModel.from_dict(model_dict), data
    except (TypeError, ValueError) as e:
        raise ValueError(f"--profile {path}: {e}") from None
