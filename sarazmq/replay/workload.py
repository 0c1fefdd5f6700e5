"""Workloads for the replay harness: lengths and arrival times, fitted to the machine.

A `WorkloadSpec` says where request lengths come from (fixed / uniform / zipf / a trace),
how requests arrive (Poisson / gamma / all at once / the trace's own times) and how a
production trace is fitted to a small machine (a window of rows, stretched time, scaled
and clipped lengths). `build_workload` turns it into `WorkloadRequest`s whose prompts are
random token ids of exactly the requested length, as Sarathi-Serve's benchmark does; the
driver sends each with `ignore_eos=True` and `max_tokens=output_tokens` so that the output
length is exactly the trace's too. `sarazmq.replay.describe` reports what was done, for
the run header.

Order of operations: select rows (`start`, `max_requests`) -> lengths (source, then
`length_scale`, then clip to [min, max]) -> arrivals (source, then `time_scale`) -> prompts.

Randomness is seeded per purpose (arrivals, input lengths, output lengths, prompts), and a
prompt's ids depend only on (seed, source row), so a trace row gets the same prompt
whatever window of the trace is replayed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sarazmq.replay.distributions import (
    gamma_arrivals,
    uniform_lengths,
    zipf_lengths,
)
from sarazmq.replay.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, load_trace

LENGTH_KINDS = ("auto", "fixed", "uniform", "zipf", "trace")
ARRIVAL_KINDS = ("auto", "poisson", "gamma", "all_at_once", "trace")

# Independent random streams, so that e.g. changing the arrival process leaves the
# lengths and prompts unchanged.
_STREAM_ARRIVALS = 0
_STREAM_INPUT = 1
_STREAM_OUTPUT = 2
_STREAM_PROMPT = 3
_STREAM_PREFIX_BLOCK = 4


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """What to replay and how to fit it to the machine.

    vocab_size: prompt ids are drawn from [0, vocab_size) ...
    avoid_ids: ... minus these (special tokens: BOS/EOS/pad/chat markers).
    trace_path / trace_kind: a trace file and its kind ("auto" = from the header).
    lengths: "fixed" (input_tokens, output_tokens) | "uniform" (input_range, output_range,
        inclusive) | "zipf" (zipf_theta over the ranges; short lengths most frequent) |
        "trace" | "auto" (= "trace" when a trace is given, else "fixed").
    arrivals: "poisson" (qps) | "gamma" (qps, cv) | "all_at_once" | "trace" | "auto"
        (= "poisson" when qps is set, else "trace"). Setting qps with a trace re-times
        its requests as a Poisson process at that rate.
    max_requests: how many requests (required without a trace; default all rows).
    start: index of the first trace row used.
    time_scale: multiplies every inter-arrival gap (2.0 = half the rate).
    length_scale: multiplies input and output lengths (rounded) before clipping.
    max_input_tokens / max_output_tokens: clip lengths to at most this (None = no clip).
    min_input_tokens / min_output_tokens: raise lengths to at least this (>= 1).
    prefix_sharing: build prompts from the trace's hash_ids (Mooncake): rows with equal
        leading ids share those prompt blocks, so a prefix cache sees the trace's reuse.
    seed: seeds every random choice.
    """

    vocab_size: int
    avoid_ids: tuple[int, ...] = ()
    trace_path: str | None = None
    trace_kind: str = "auto"
    lengths: str = "auto"
    input_tokens: int = 512
    output_tokens: int = 128
    input_range: tuple[int, int] = (32, 1024)
    output_range: tuple[int, int] = (16, 256)
    zipf_theta: float = 1.1
    arrivals: str = "auto"
    qps: float | None = None
    cv: float = 1.0
    max_requests: int | None = None
    start: int = 0
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    min_input_tokens: int = 1
    min_output_tokens: int = 1
    prefix_sharing: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.trace_path, Path):  # keep the spec JSON-ready
            object.__setattr__(self, "trace_path", str(self.trace_path))
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1")
        if len({i for i in self.avoid_ids if 0 <= i < self.vocab_size}) >= self.vocab_size:
            raise ValueError("avoid_ids leaves no token id in [0, vocab_size) to draw from")
        if self.lengths not in LENGTH_KINDS:
            raise ValueError(f"lengths={self.lengths!r} is not one of {LENGTH_KINDS}")
        if self.arrivals not in ARRIVAL_KINDS:
            raise ValueError(f"arrivals={self.arrivals!r} is not one of {ARRIVAL_KINDS}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"input_tokens={self.input_tokens} and output_tokens={self.output_tokens} "
                "must be >= 1"
            )
        for name in ("input_range", "output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)} must satisfy 1 <= lo <= hi")
        if not (self.zipf_theta > 0 and math.isfinite(self.zipf_theta)):
            raise ValueError(f"zipf_theta={self.zipf_theta} must be a finite number > 0")
        if self.qps is not None and not (self.qps > 0 and math.isfinite(self.qps)):
            raise ValueError(f"qps={self.qps} must be a finite number > 0")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"cv={self.cv} must be a finite number > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests={self.max_requests} must be >= 1")
        if self.start < 0:
            raise ValueError(f"start={self.start} must be >= 0")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale={self.time_scale} must be a finite number > 0")
        if not (self.length_scale > 0 and math.isfinite(self.length_scale)):
            raise ValueError(f"length_scale={self.length_scale} must be a finite number > 0")
        if self.min_input_tokens < 1 or self.min_output_tokens < 1:
            raise ValueError(
                f"min_input_tokens={self.min_input_tokens} and "
                f"min_output_tokens={self.min_output_tokens} must be >= 1"
            )
        if self.max_input_tokens is not None and self.max_input_tokens < self.min_input_tokens:
            raise ValueError(
                f"max_input_tokens={self.max_input_tokens} < min_input_tokens="
                f"{self.min_input_tokens}"
            )
        if self.max_output_tokens is not None and self.max_output_tokens < self.min_output_tokens:
            raise ValueError(
                f"max_output_tokens={self.max_output_tokens} < min_output_tokens="
                f"{self.min_output_tokens}"
            )
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        # Cross-field rules that need no trace contents.
        if self.trace_path is None:
            if self.max_requests is None:
                raise ValueError("max_requests is required when no trace_path is given")
            if self.lengths == "trace":
                raise ValueError("lengths='trace' needs a trace_path")
            if self.arrivals == "trace":
                raise ValueError("arrivals='trace' needs a trace_path")
            if self.arrivals == "auto" and self.qps is None:
                raise ValueError(
                    "no trace_path: set qps (Poisson) or arrivals ('gamma', 'all_at_once')"
                )
            if self.prefix_sharing:
                raise ValueError("prefix_sharing needs a trace_path with hash_ids")
        if self.arrivals in ("poisson", "gamma") and self.qps is None:
            raise ValueError(f"arrivals={self.arrivals!r} needs qps")
        if self.arrivals in ("trace", "all_at_once") and self.qps is not None:
            raise ValueError(
                f"qps={self.qps} conflicts with arrivals={self.arrivals!r}; "
                "use time_scale to stretch a trace's own arrival times"
            )
        if self.prefix_sharing and self.resolved_lengths() != "trace":
            raise ValueError("prefix_sharing needs lengths from the trace")

    def resolved_lengths(self) -> str:
        """The length source after "auto" is resolved."""
        if self.lengths != "auto":
            return self.lengths
        return "trace" if self.trace_path is not None else "fixed"

    def resolved_arrivals(self) -> str:
        """The arrival process after "auto" is resolved."""
        if self.arrivals != "auto":
            return self.arrivals
        return "poisson" if self.qps is not None else "trace"

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (tuples become lists)."""
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


class PromptSource:
    """Makes a request's prompt ids on demand; one is shared by a workload's requests.

    Prompts are not stored: a whole Mooncake trace would be ~145M ids. They are random
    ids from the allowed set, seeded by (seed, source row); with prefix sharing each hash
    id maps to one fixed random block, so rows with equal leading ids share those blocks.
    """

    __slots__ = ("_allowed", "_block", "_prefix_sharing", "_seed")

    def __init__(self, spec: WorkloadSpec) -> None:
        self._seed = spec.seed
        self._allowed = _allowed_ids(spec)  # [n_allowed]
        self._prefix_sharing = spec.prefix_sharing
        # The block length scales with the lengths so that the shared fraction of a
        # prompt is what the trace says.
        self._block = max(1, math.floor(MOONCAKE_BLOCK_TOKENS * spec.length_scale + 0.5))

    def _key(self) -> tuple[int, bool, int, bytes]:
        return (self._seed, self._prefix_sharing, self._block, self._allowed.tobytes())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptSource):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._allowed[rng.integers(0, len(self._allowed), n)]  # [n]

    def tokens(self, length: int, source_index: int, hash_ids: tuple[int, ...]) -> list[int]:
        """The prompt of a request: exactly `length` ids."""
        if not self._prefix_sharing:
            return self._draw(_rng(self._seed, _STREAM_PROMPT, source_index), length).tolist()
        parts: list[np.ndarray] = []
        have = 0
        for h in hash_ids:
            if have >= length:
                break
            parts.append(self._draw(_rng(self._seed, _STREAM_PREFIX_BLOCK, h), self._block))
            have += self._block
        if have < length:  # hash_ids shorter than the prompt: fill with the row's own ids
            rng = _rng(self._seed, _STREAM_PROMPT, source_index)
            parts.append(self._draw(rng, length - have))
        return np.concatenate(parts)[:length].tolist()


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send.

    request_id: unique within the workload, in arrival order ("req-0", "req-1", ...).
    arrival_s: when to send it, seconds after the replay starts (first request at 0).
    input_tokens: the fitted prompt length; `prompt_token_ids` has exactly this many ids.
    output_tokens: tokens to generate (send as max_tokens with ignore_eos=True).
    source_index: the trace row (or synthetic draw) it came from.
    source_input_tokens / source_output_tokens: lengths before length_scale and clipping.
    hash_ids: the trace row's prefix-block ids (Mooncake; empty otherwise).
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    source_index: int
    source_input_tokens: int
    source_output_tokens: int
    hash_ids: tuple[int, ...] = ()
    prompts: PromptSource | None = field(default=None, repr=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt ids, generated on each access (deterministic; keep the list if it
        is needed twice)."""
        if self.prompts is None:
            raise ValueError(f"request {self.request_id!r} has no prompt source")
        return self.prompts.tokens(self.input_tokens, self.source_index, self.hash_ids)


# ---------------------------------------------------------------------------- generators


def _rng(seed: int, stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *more])


def fit_lengths(
    raw: np.ndarray, scale: float, lo: int, hi: int | None
) -> tuple[np.ndarray, int, int]:
    """Scale (round half up) then clip to [lo, hi]; returns (lengths, n_clipped, n_raised)."""
    scaled = np.floor(raw.astype(np.float64) * scale + 0.5).astype(np.int64)
    n_clipped = int((scaled > hi).sum()) if hi is not None else 0
    n_raised = int((scaled < lo).sum())
    return np.clip(scaled, lo, hi), n_clipped, n_raised


# ---------------------------------------------------------------------------- build


def _select_rows(spec: WorkloadSpec) -> tuple[list[TraceRow], int]:
    """The trace window the spec asks for, and the number of rows in the whole trace."""
    assert spec.trace_path is not None  # checked by the caller
    rows = load_trace(spec.trace_path, spec.trace_kind)
    if spec.start >= len(rows):
        raise ValueError(f"start={spec.start} is past the end of the trace ({len(rows)} rows)")
    end = len(rows) if spec.max_requests is None else spec.start + spec.max_requests
    return rows[spec.start : end], len(rows)


def _source_lengths(
    spec: WorkloadSpec, rows: Sequence[TraceRow] | None, n: int
) -> tuple[np.ndarray, np.ndarray]:
    kind = spec.resolved_lengths()
    if kind == "trace":
        assert rows is not None
        return (
            np.array([r.input_tokens for r in rows], dtype=np.int64),
            np.array([r.output_tokens for r in rows], dtype=np.int64),
        )
    if kind == "fixed":
        return np.full(n, spec.input_tokens), np.full(n, spec.output_tokens)
    rin, rout = _rng(spec.seed, _STREAM_INPUT), _rng(spec.seed, _STREAM_OUTPUT)
    if kind == "uniform":
        return (
            uniform_lengths(n, *spec.input_range, rin),
            uniform_lengths(n, *spec.output_range, rout),
        )
    return (
        zipf_lengths(n, spec.zipf_theta, *spec.input_range, rin),
        zipf_lengths(n, spec.zipf_theta, *spec.output_range, rout),
    )


def _arrivals(spec: WorkloadSpec, rows: Sequence[TraceRow] | None, n: int) -> np.ndarray:
    kind = spec.resolved_arrivals()
    if kind == "trace":
        assert rows is not None
        times = [r.arrival_s for r in rows]
        if any(t is None for t in times):
            raise ValueError(
                f"trace {spec.trace_path!r} has no arrival times: set qps (Poisson) or "
                "arrivals ('gamma' with qps, 'all_at_once')"
            )
        base = np.array(times, dtype=np.float64)
        base -= base.min()  # the window starts at 0 whatever `start` is
    elif kind == "all_at_once":
        base = np.zeros(n)
    else:
        assert spec.qps is not None
        cv = spec.cv if kind == "gamma" else 1.0
        base = gamma_arrivals(n, spec.qps, cv, _rng(spec.seed, _STREAM_ARRIVALS))
    return base * spec.time_scale


def _allowed_ids(spec: WorkloadSpec) -> np.ndarray:
    """Token ids a prompt may use [n_allowed]."""
    return np.setdiff1d(
        np.arange(spec.vocab_size, dtype=np.int64), np.array(spec.avoid_ids, dtype=np.int64)
    )


def build_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of `spec`, sorted by arrival time (ties keep source order)."""
    rows: list[TraceRow] | None = None
    if spec.trace_path is not None:
        rows, _ = _select_rows(spec)
        n = len(rows)
        if spec.prefix_sharing and not any(r.hash_ids for r in rows):
            raise ValueError(f"prefix_sharing: trace {spec.trace_path!r} has no hash_ids")
    else:
        assert spec.max_requests is not None
        n = spec.max_requests
    src_in, src_out = _source_lengths(spec, rows, n)
    fit_in, _, _ = fit_lengths(
        src_in, spec.length_scale, spec.min_input_tokens, spec.max_input_tokens
    )
    fit_out, _, _ = fit_lengths(
        src_out, spec.length_scale, spec.min_output_tokens, spec.max_output_tokens
    )
    arrivals = _arrivals(spec, rows, n)
    order = np.argsort(arrivals, kind="stable")
    prompts = PromptSource(spec)
    requests = []
    for k, i in enumerate(order.tolist()):
        source_index = spec.start + i if rows is not None else i
        requests.append(
            WorkloadRequest(
                request_id=f"req-{k}",
                arrival_s=float(arrivals[i]),
                input_tokens=int(fit_in[i]),
                output_tokens=int(fit_out[i]),
                source_index=source_index,
                source_input_tokens=int(src_in[i]),
                source_output_tokens=int(src_out[i]),
                hash_ids=rows[i].hash_ids if rows is not None else (),
                prompts=prompts,
            )
        )
    return requests


# ---------------------------------------------------------------------------- describe
