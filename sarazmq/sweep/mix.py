"""The sweep's workload: short and long prompts mixed at a share, Poisson arrivals.

Each request is long with probability `share`. Short lengths (prompt, output) come from
one source and long ones from another: a trace's rows drawn uniformly with replacement
(defaults: the Azure conversation trace for short, the arXiv-summarisation trace for
long) or fixed lengths. Both are fitted to the machine as replay fits a trace
(`fit_lengths`: --length-scale, then clipping). Arrivals are Poisson at the point's rate;
prompts are random ids from replay's `PromptSource`.

Common random numbers: request i's draw u_i (long iff u_i < share), its short and long
candidate lengths and its arrival gap come from separate streams seeded by the seed
alone, so the same seed gives the same workload for every engine, and raising the share
turns some short requests long without changing the others.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sarazmq.replay.distributions import gamma_arrivals
from sarazmq.replay.traces import load_trace
from sarazmq.replay.workload import PromptSource, WorkloadRequest, WorkloadSpec, fit_lengths

#: the two traces ship in the package (sarazmq/replay/data, provenance in its README)
_TRACES = Path(__file__).resolve().parents[1] / "replay" / "data"
DEFAULT_SHORT_TRACE = _TRACES / "azure_llm_2023_conv.csv"
DEFAULT_LONG_TRACE = _TRACES / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"

# Random streams (distinct from replay's 0..4 so nothing aliases them by accident).
_STREAM_KIND = 10
_STREAM_SHORT = 11
_STREAM_LONG = 12
_STREAM_ARRIVALS = 13


@dataclass(frozen=True)
class LengthSource:
    """Where one class of requests gets its (prompt, output) lengths: a trace file
    (rows drawn uniformly with replacement) or fixed lengths."""

    trace_path: str | None = None
    trace_kind: str = "auto"
    input_tokens: int | None = None
    output_tokens: int | None = None

    def __post_init__(self) -> None:
        fixed = self.input_tokens is not None or self.output_tokens is not None
        if (self.trace_path is None) == (not fixed):
            if self.trace_path is None:
                raise ValueError("a LengthSource needs trace_path or input/output_tokens")
            raise ValueError("give a LengthSource trace_path or fixed lengths, not both")
        if fixed and (
            self.input_tokens is None
            or self.output_tokens is None
            or self.input_tokens < 1
            or self.output_tokens < 1
        ):
            raise ValueError(
                f"fixed lengths input_tokens={self.input_tokens} output_tokens="
                f"{self.output_tokens} must both be set and >= 1"
            )

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """n (prompt, output) lengths before fitting: two int arrays [n]."""
        if self.trace_path is None:
            assert self.input_tokens is not None and self.output_tokens is not None
            return np.full(n, self.input_tokens), np.full(n, self.output_tokens)
        ins, outs = _trace_lengths(str(self.trace_path), self.trace_kind)
        idx = rng.integers(0, ins.size, n)
        return ins[idx], outs[idx]

    def describe(self) -> str:
        if self.trace_path is None:
            return f"fixed {self.input_tokens}/{self.output_tokens} tokens"
        return f"trace {Path(self.trace_path).name}"


@functools.lru_cache(maxsize=8)
def _trace_lengths(path: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    rows = load_trace(path, kind)
    if not rows:
        raise ValueError(f"trace {path!r} has no rows")
    ins = np.array([r.input_tokens for r in rows], dtype=np.int64)
    outs = np.array([r.output_tokens for r in rows], dtype=np.int64)
    return ins, outs


@dataclass(frozen=True, kw_only=True)
class MixSpec:
    """What every point's workload shares (the point adds share, rate and seed).

    vocab_size / avoid_ids: prompt ids, as in `WorkloadSpec`.
    num_requests: requests per point.
    length_scale, max/min_input/output_tokens: fitting, as replay's flags (both classes).
    """

    vocab_size: int
    short: LengthSource
    long: LengthSource
    num_requests: int
    avoid_ids: tuple[int, ...] = ()
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    min_input_tokens: int = 1
    min_output_tokens: int = 1

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        # the fitting fields are checked by the WorkloadSpec built for the prompts
        self.prompt_spec(seed=0, qps=1.0)

    def prompt_spec(self, *, seed: int, qps: float) -> WorkloadSpec:
        """The WorkloadSpec of a point's prompts (and the checks of the fitting flags)."""
        return WorkloadSpec(
            vocab_size=self.vocab_size,
            avoid_ids=self.avoid_ids,
            max_requests=self.num_requests,
            qps=qps,
            length_scale=self.length_scale,
            max_input_tokens=self.max_input_tokens,
            max_output_tokens=self.max_output_tokens,
            min_input_tokens=self.min_input_tokens,
            min_output_tokens=self.min_output_tokens,
            seed=seed,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "short": self.short.describe(),
            "long": self.long.describe(),
            "num_requests": self.num_requests,
            "length_scale": self.length_scale,
            "max_input_tokens": self.max_input_tokens,
            "max_output_tokens": self.max_output_tokens,
            "min_input_tokens": self.min_input_tokens,
            "min_output_tokens": self.min_output_tokens,
        }


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def long_mask(num_requests: int, share: float, seed: int) -> np.ndarray:
    """Which of the requests (in draw order) are long: bool [num_requests]."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share} must be in [0, 1]")
    return _rng(seed, _STREAM_KIND).random(num_requests) < share


def build_mixed_workload(
    spec: MixSpec, *, share: float, qps: float, seed: int
) -> list[WorkloadRequest]:
    """The point's requests in arrival order: long with probability `share`, Poisson
    arrivals at `qps` requests/s (see the module docstring)."""
    if not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"qps={qps} must be a finite number > 0")
    n = spec.num_requests
    is_long = long_mask(n, share, seed)
    s_in, s_out = spec.short.draw(n, _rng(seed, _STREAM_SHORT))
    l_in, l_out = spec.long.draw(n, _rng(seed, _STREAM_LONG))
    src_in = np.where(is_long, l_in, s_in)  # [n]
    src_out = np.where(is_long, l_out, s_out)  # [n]
    fit_in, _, _ = fit_lengths(
        src_in, spec.length_scale, spec.min_input_tokens, spec.max_input_tokens
    )
    fit_out, _, _ = fit_lengths(
        src_out, spec.length_scale, spec.min_output_tokens, spec.max_output_tokens
    )
    arrivals = gamma_arrivals(n, qps, 1.0, _rng(seed, _STREAM_ARRIVALS))  # sorted, from 0
    prompts = PromptSource(spec.prompt_spec(seed=seed, qps=qps))
    return [
        WorkloadRequest(
            request_id=f"req-{i}",
            arrival_s=float(arrivals[i]),
            input_tokens=int(fit_in[i]),
            output_tokens=int(fit_out[i]),
            source_index=i,
            source_input_tokens=int(src_in[i]),
            source_output_tokens=int(src_out[i]),
            prompts=prompts,
        )
        for i in range(n)
    ]
