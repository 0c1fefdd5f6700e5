"""The sweep's grid: policies x chunk sizes x long-prompt shares x loads x seeds.

A point is one run of one workload (share, load, seed) on one engine (policy, chunk).
Its key is stable across invocations (it names the point in points.jsonl and its run
folder), so a rerun can skip what is done.

Chunk-independent policies: `orca` and `fastertransformer` have no token budget, and
`vllm`'s budget is max(chunk_size, max_model_len), the same for every chunk <=
max_model_len. Such a policy runs once per (share, load, seed), with chunk None in its
point ("any" in its key), on an engine built with `ENGINE_CHUNK_FOR_INDEPENDENT`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sarazmq.config import DEFAULT_CHUNK_SIZE

DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_SHARES = (0.0, 0.1, 0.25, 0.5)
#: The chunk the best-chunk table compares against (the engine's default).
DEFAULT_CHUNK = DEFAULT_CHUNK_SIZE
#: The chunk size an engine of a chunk-independent policy is built with (any would do).
ENGINE_CHUNK_FOR_INDEPENDENT = DEFAULT_CHUNK
LOAD_KINDS = ("qps", "capacity")

_ALWAYS_INDEPENDENT = ("orca", "fastertransformer")


def chunk_independent(policy: str, chunks: Sequence[int], max_model_len: int) -> bool:
    """Whether `policy` schedules the same for every chunk size in `chunks` (see the
    module docstring); max_model_len: the engine's (resolved, > 0)."""
    if policy in _ALWAYS_INDEPENDENT:
        return True
    if policy == "vllm":
        return max(chunks) <= max_model_len
    return False


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True, order=True)
class SweepPoint:
    """One point of the grid.

    chunk: the chunk size, or None for a chunk-independent policy (run once).
    load: a rate in requests/s (load_kind "qps") or a fraction of the share's capacity
        (load_kind "capacity"; the rate is resolved when the point runs).
    """

    policy: str
    chunk: int | None
    share: float
    load: float
    load_kind: str
    seed: int

    @property
    def key(self) -> str:
        """Stable, file-name safe: e.g. sarathi_c256_s0.25_q0.5_seed0, vllm_cany_s0_l0.8_seed1."""
        chunk = "any" if self.chunk is None else str(self.chunk)
        tag = "q" if self.load_kind == "qps" else "l"
        return f"{self.policy}_c{chunk}_s{_num(self.share)}_{tag}{_num(self.load)}_seed{self.seed}"

    @property
    def engine_chunk(self) -> int:
        """The chunk size its engine is built with."""
        return ENGINE_CHUNK_FOR_INDEPENDENT if self.chunk is None else self.chunk


@dataclass(frozen=True)
class SweepGrid:
    """The grid. loads: rates (load_kind "qps") or capacity fractions ("capacity").
    seeds: the workload seeds each point is repeated with. max_model_len: the engine's
    (resolved), for the vllm rule."""

    policies: tuple[str, ...]
    chunks: tuple[int, ...]
    shares: tuple[float, ...]
    loads: tuple[float, ...]
    load_kind: str
    seeds: tuple[int, ...]
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("policies", "chunks", "shares", "loads", "seeds"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} is empty")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}={values} has a duplicate")
        if any(c < 1 for c in self.chunks):
            raise ValueError(f"chunks={self.chunks}: every chunk size must be >= 1")
        if any(not 0.0 <= s <= 1.0 for s in self.shares):
            raise ValueError(f"shares={self.shares}: every share must be in [0, 1]")
        if any(not (x > 0 and math.isfinite(x)) for x in self.loads):
            raise ValueError(f"loads={self.loads}: every load must be a finite number > 0")
        if self.load_kind not in LOAD_KINDS:
            raise ValueError(f"load_kind={self.load_kind!r} is not one of {LOAD_KINDS}")
        if any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds={self.seeds}: seeds must be >= 0")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")

    def independent_policies(self) -> tuple[str, ...]:
        """Policies run once per (share, load, seed), not per chunk."""
        return tuple(
            p for p in self.policies if chunk_independent(p, self.chunks, self.max_model_len)
        )

    def engines(self) -> list[tuple[str, int | None]]:
        """(policy, chunk or None) of every engine the grid needs, in run order."""
        independent = set(self.independent_policies())
        out: list[tuple[str, int | None]] = []
        for policy in self.policies:
            if policy in independent:
                out.append((policy, None))
            else:
                out.extend((policy, c) for c in self.chunks)
        return out

    def points_of(self, policy: str, chunk: int | None) -> list[SweepPoint]:
        """The points one engine runs, by share, then load, then seed."""
        return [
            SweepPoint(policy, chunk, share, load, self.load_kind, seed)
            for share in self.shares
            for load in self.loads
            for seed in self.seeds
        ]

    def points(self) -> list[SweepPoint]:
        """Every point, grouped by engine (the run order)."""
        return [p for policy, chunk in self.engines() for p in self.points_of(policy, chunk)]

    def to_dict(self) -> dict[str, object]:
        return {
            "policies": list(self.policies),
            "chunks": list(self.chunks),
            "shares": list(self.shares),
            "loads": list(self.loads),
            "load_kind": self.load_kind,
            "seeds": list(self.seeds),
            "max_model_len": self.max_model_len,
            "chunk_independent_policies": list(self.independent_policies()),
            "num_points": len(self.points()),
        }
