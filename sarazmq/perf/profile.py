"""Measuring this machine's engine over a grid of iteration shapes and fitting its latency
model (`sarazmq profile`).

The engine's model runner is built in process (as a worker builds it), each grid point is
timed with `ShapesRunner` (median of a few runs after a warm-up) in a shuffled order, the
piecewise-linear model is fitted on a training split, points far slower than that fit are
timed once more (other load only ever slows a run), the fit is redone, and its error is
reported on the held-out points.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.model.kv_cache import kv_cache_bytes_per_block
from sarazmq.perf.accuracy import ErrorReport
from sarazmq.perf.accuracy import prediction_error as error_of
from sarazmq.perf.machine import MachineProbe, probe_machine
from sarazmq.perf.shapes_runner import ShapesRunner
from sarazmq.resolve import resolve_engine_config
from sarazmq.scheduler import IterationShape, PiecewiseLinearModel, fit_latency_model
from sarazmq.worker import build_model_runner

#: the KV pool the profile allocates when the options leave it to memory (the grid's largest
#: decode batches need more; `ShapesRunner` then hands blocks out again)
MAX_POOL_BYTES = 1 << 30
HOLDOUT_FRACTION = 0.25
#: a point measured this much slower than the first fit predicts is timed again
RETIME_FACTOR = 1.5


@dataclass(frozen=True)
class GridPoint:
    """One iteration to time: prefill chunks (start, num_tokens) and decode contexts."""

    prefills: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decode_contexts)

    @property
    def longest(self) -> int:
        return max([s + n for s, n in self.prefills] + list(self.decode_contexts))


def profile_grid(quick: bool, max_model_len: int, max_num_seqs: int) -> list[GridPoint]:
    """The shapes to time: prefill chunks at several prior contexts, decode batches at
    several contexts, and hybrids of both; those longer than `max_model_len` or with more
    sequences than `max_num_seqs` are left out. quick: a small grid (for tests)."""
    pts: list[GridPoint] = []
    if quick:
        prefill = [(c, s) for c in (8, 32, 64) for s in (0, 32)]
        decode = [(b, c) for b in (1, 4, 8) for c in (16, 64)]
        hybrid = [(32, 16, 2, 32), (8, 16, 4, 64), (16, 0, 8, 16)]
    else:
        prefill = [(c, 0) for c in (16, 32, 64, 128, 256, 512, 1024, 2048)]
        prefill += [(c, s) for c in (64, 256, 512) for s in (1024, 2048)]
        decode = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (64, 512, 2048)]
        hybrid = [(c, 512, b, 512) for c in (64, 256, 512) for b in (8, 32)]
        hybrid += [(32, 1024, 4, 2048), (128, 0, 16, 1024), (1024, 0, 2, 256)]
    pts += [GridPoint(prefills=((s, c),)) for c, s in prefill]
    pts += [GridPoint(decode_contexts=(c,) * b) for b, c in decode]
    pts += [GridPoint(((s, c),), (dc,) * b) for c, s, b, dc in hybrid]
    if quick:  # two chunks in one iteration
        pts.append(GridPoint(((0, 16), (16, 8)), (32, 32)))
    else:
        pts.append(GridPoint(((0, 128), (512, 128)), (512,) * 16))
    return [
        p
        for p in pts
        if p.longest <= max_model_len and len(p.prefills) + len(p.decode_contexts) <= max_num_seqs
    ]


def runs_for(point: GridPoint, runs: int) -> tuple[int, int]:
    """(timed runs, warm-up runs) of a point: `runs` and a warm-up for small ones, fewer
    for long prefills and no warm-up past 1024 tokens (seconds each on a CPU, where a
    first call's one-off costs and one run's noise are small against its length)."""
    n = point.num_tokens
    timed = max(1, runs if n <= 256 else runs - 1 if n <= 1024 else runs - 2)
    return timed, 0 if n > 1024 else 1


@dataclass(frozen=True)
class ProfileResult:
    machine: MachineProbe
    engine: dict[str, Any]
    shapes: list[IterationShape]
    seconds: list[float]
    is_test: list[bool]
    model: PiecewiseLinearModel
    train_error: ErrorReport
    test_error: ErrorReport
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        samples = [
            {**_shape_dict(s), "seconds": t, "set": "test" if test else "train"}
            for s, t, test in zip(self.shapes, self.seconds, self.is_test)
        ]
        return {
            "kind": "measured",
            "timed": "ModelRunner.execute (the engine's forward_s: metadata, forward, LM head, "
            "sampling); the scheduler's and transport's part of an iteration is not in it",
            "machine": self.machine.to_dict(),
            "engine": self.engine,
            "samples": samples,
            "model": self.model.to_dict(),
            "error": {"train": self.train_error.to_dict(), "test": self.test_error.to_dict()},
            "wall_s": self.wall_s,
        }


def _shape_dict(shape: IterationShape) -> dict[str, int]:
    return {f: getattr(shape, f) for f in shape.__struct_fields__}


def build_runner(config: EngineConfig) -> tuple[Any, EngineConfig, ModelConfig]:
    """This engine's rank-0 model runner, in process; a KV pool left to memory is capped
    at MAX_POOL_BYTES. Returns (runner, resolved config, model config)."""
    if config.tensor_parallel_size != 1:
        raise ValueError("--tp: the profile runs one in-process worker; give --tp 1")
    resolved, model_config = resolve_engine_config(config)
    if config.cache.num_blocks == 0:
        per_block = kv_cache_bytes_per_block(
            model_config,
            resolved.cache.block_size,
            getattr(torch, resolved.dtype),
            1,
            kv_cache_dtype=resolved.cache.kv_cache_dtype,
        )
        cap = max(1, MAX_POOL_BYTES // per_block)
        cache = dataclasses.replace(resolved.cache, num_blocks=min(resolved.cache.num_blocks, cap))
        resolved = dataclasses.replace(resolved, cache=cache)
    return build_model_runner(resolved, model_config), resolved, model_config


def run_profile(
    config: EngineConfig,
    quick: bool = False,
    runs: int = 3,
    progress: Callable[[str], None] | None = None,
) -> ProfileResult:
    """Builds the engine's runner, probes the machine, times the grid, fits and tests."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    runner, resolved, model_config = build_runner(config)
    machine = probe_machine(getattr(torch, resolved.dtype), quick=True)
    say(f"machine: {machine}")
    grid = profile_grid(quick, resolved.scheduler.max_model_len, resolved.scheduler.max_num_seqs)
    if len(grid) < 8:
        raise ValueError(
            f"only {len(grid)} grid shapes fit max_model_len={resolved.scheduler.max_model_len}"
        )
    bench = ShapesRunner(runner, wrap_blocks=True)
    # timed in a shuffled order: a burst of other load on a shared machine then hits
    # scattered shapes, not one region of the grid
    order = list(range(len(grid)))
    random.Random(resolved.seed).shuffle(order)
    timed_shapes: dict[int, tuple[IterationShape, float]] = {}
    for k, i in enumerate(order):
        point = grid[i]
        timed, warmup = runs_for(point, runs)
        timed_shapes[i] = bench.time_iteration(point.prefills, point.decode_contexts, timed, warmup)
        say(f"[{k + 1}/{len(grid)}] {_describe(point)}: {timed_shapes[i][1] * 1e3:.1f} ms")
    shapes = [timed_shapes[i][0] for i in range(len(grid))]
    seconds = [timed_shapes[i][1] for i in range(len(grid))]
    is_test = split(len(shapes), resolved.seed)
    train = [i for i, t in enumerate(is_test) if not t]
    test = [i for i, t in enumerate(is_test) if t]
    model = fit_latency_model([shapes[i] for i in train], [seconds[i] for i in train])
    # Other load on a shared machine only ever slows a run down, in bursts that can outlast
    # a point's few runs: a point far slower than the first fit says is timed once more
    # (train and held-out alike) and keeps the lower time; a shape that really is that
    # slow stays slow. Then the fit is redone.
    retimed = 0
    for i in order:
        if seconds[i] > RETIME_FACTOR * model.predict(shapes[i]):
            point = grid[i]
            timed, warmup = runs_for(point, runs)
            _, again = bench.time_iteration(point.prefills, point.decode_contexts, timed, warmup)
            say(f"[retime] {_describe(point)}: {seconds[i] * 1e3:.1f} -> {again * 1e3:.1f} ms")
            seconds[i] = min(seconds[i], again)
            retimed += 1
    if retimed:
        model = fit_latency_model([shapes[i] for i in train], [seconds[i] for i in train])
    engine = {
        "model": resolved.model,
        "architecture": model_config.architecture,
        "dtype": resolved.dtype,
        "device": resolved.device,
        "attention_backend": resolved.attention_backend,
        "enforce_eager": resolved.enforce_eager,
        "block_size": resolved.cache.block_size,
        "num_kv_blocks": resolved.cache.num_blocks,
        "threads": torch.get_num_threads(),
        "quick": quick,
        "runs": runs,
        "retimed": retimed,
    }
    return ProfileResult(
        machine=machine,
        engine=engine,
        shapes=shapes,
        seconds=seconds,
        is_test=is_test,
        model=model,
        train_error=error_of(model, [shapes[i] for i in train], [seconds[i] for i in train]),
        test_error=error_of(model, [shapes[i] for i in test], [seconds[i] for i in test]),
        wall_s=time.perf_counter() - t0,
    )


def split(n: int, seed: int) -> list[bool]:
    """Which of n points are held out (HOLDOUT_FRACTION of them, at least one, drawn by
    `seed`)."""
    k = max(1, round(n * HOLDOUT_FRACTION))
    held = set(random.Random(seed).sample(range(n), k))
    return [i in held for i in range(n)]


def _describe(point: GridPoint) -> str:
    parts = [f"chunk {n}@{s}" for s, n in point.prefills]
    if point.decode_contexts:
        ctx = sorted(set(point.decode_contexts))
        parts.append(f"{len(point.decode_contexts)} decodes@{'/'.join(map(str, ctx))}")
    return " + ".join(parts)
