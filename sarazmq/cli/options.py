"""Options shared by several commands, each defined once, and what they build."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import click

from sarazmq.config import (
    ATTENTION_BACKENDS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    DTYPES,
    KV_CACHE_DTYPES,
    POLICIES,
    EngineConfig,
)

Decorator = Callable[[Any], Any]


def stack(*options: Decorator) -> Decorator:
    """One decorator applying `options` in the order given (first = first in --help)."""

    def deco(f: Any) -> Any:
        for opt in reversed(options):
            f = opt(f)
        return f

    return deco


#: Engine options that shape scheduling: every command that starts or simulates an
#: engine has them (`engine_options` and the simulator's `sim_scheduling_options`).
policy_options = stack(
    click.option(
        "--scheduler",
        "scheduler",
        type=click.Choice(POLICIES),
        default="sarathi",
        show_default=True,
        help="batching policy",
    ),
    click.option(
        "--chunk-size",
        default=DEFAULT_CHUNK_SIZE,
        show_default=True,
        help="per-iteration token budget",
    ),
    click.option("--max-num-seqs", default=DEFAULT_MAX_NUM_SEQS, show_default=True),
    click.option(
        "--tbt-slo",
        type=float,
        default=0.0,
        show_default=True,
        help="time-between-tokens target (s): each iteration's chunk is the largest whose "
        "predicted time fits the decodes' slack; --chunk-size is its upper bound (sarathi; "
        "0 = fixed chunk; calibrated at startup)",
    ),
    click.option("--block-size", default=16, show_default=True),
    click.option(
        "--prefix-caching/--no-prefix-caching",
        "enable_prefix_caching",
        default=True,
        show_default=True,
        help="reuse the KV of shared prompt prefixes (whole blocks)",
    ),
)

#: Every option that builds an EngineConfig; each parameter is named as in
#: `EngineConfig.from_options`, so `engine_config(kw)` passes them through.
engine_options = stack(
    click.option(
        "--model",
        default=DEFAULT_MODEL,
        show_default=True,
        help="model name, .gguf file, or Hugging Face folder",
    ),
    policy_options,
    click.option(
        "--tp", "tensor_parallel_size", default=1, show_default=True, help="tensor-parallel workers"
    ),
    click.option(
        "--pp",
        "pipeline_parallel_size",
        default=1,
        show_default=True,
        help="pipeline stages (the layers split evenly; tp x pp workers in all)",
    ),
    click.option(
        "--detokenizers",
        "num_detokenizers",
        default=1,
        show_default=True,
        help="detokenizer processes",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default="auto",
        show_default=True,
        help="auto: bfloat16 where the hardware computes it natively (AMX or AVX512-BF16 CPUs, "
        "CUDA GPUs with bf16), else float32",
    ),
    click.option(
        "--kv-cache-dtype",
        type=click.Choice(KV_CACHE_DTYPES),
        default="auto",
        show_default=True,
        help="auto: the model's dtype; int8: half the bytes of bf16 per cached token "
        "(faster decode attention, more tokens in the pool, ~7 bits of precision per row)",
    ),
    click.option(
        "--num-kv-blocks",
        default=0,
        show_default=True,
        help="KV pool size in blocks (0 = from available memory)",
    ),
    click.option(
        "--max-model-len",
        default=0,
        show_default=True,
        help="longest prompt+output (0 = the model's context)",
    ),
    click.option(
        "--attention-backend",
        type=click.Choice(ATTENTION_BACKENDS),
        default="auto",
        show_default=True,
    ),
    click.option(
        "--enforce-eager",
        is_flag=True,
        help="run the model op by op (no fused one-call decode step)",
    ),
    click.option("--device", default="auto", show_default=True),
    click.option(
        "--threads",
        "num_threads",
        default=0,
        show_default=True,
        help="torch threads per worker (0 = cores / tp)",
    ),
    click.option(
        "--latency-profile",
        default="",
        help="with --tbt-slo: a `sarazmq profile` JSON to seed the latency model (default: "
        "calibrate at startup)",
    ),
    click.option(
        "--max-waiting",
        default=0,
        show_default=True,
        help="refuse new requests (overloaded; HTTP 503) while this many wait (0 = no limit)",
    ),
    click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="the run's seed: per-request sampling seeds drawn by the engine (and, for "
        "replay, the workload)",
    ),
)

_ENGINE_KEYS = tuple(inspect.signature(EngineConfig.from_options).parameters)


def engine_config(kw: Mapping[str, Any], **overrides: Any) -> EngineConfig:
    """The EngineConfig of a command's engine options (`overrides` win), or a one-line
    click error naming the bad value."""
    options = {k: kw[k] for k in _ENGINE_KEYS if k in kw}
    options.update(overrides)
    try:
        return EngineConfig.from_options(**options)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def server_key_option(f: Any) -> Any:
    return click.option(
        "--curve-server-key-file",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="the server's public key file (from `sarazmq keys`), for a CurveZMQ endpoint",
    )(f)


def client_kwargs(curve_server_key_file: str | None) -> dict[str, Any]:
    """Client() keyword arguments for the --curve-server-key-file option."""
    if curve_server_key_file is None:
        return {}
    from sarazmq.keys import load_public_key

    try:
        return {"curve_server_key": load_public_key(curve_server_key_file)}
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The HTTP API key from --api-key or --api-key-file (first line), or None."""
    if api_key and api_key_file:
        raise click.ClickException("give --api-key or --api-key-file, not both")
    if api_key_file is None:
        return api_key or None
    try:
        with open(api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise click.ClickException(f"cannot read --api-key-file: {e}") from None
    if not key:
        raise click.ClickException(f"--api-key-file {api_key_file} is empty")
    return key


#: The HTTP server's options (serve --http-port ..., and `sarazmq api`).
http_options = stack(
    click.option("--http-host", default="127.0.0.1", show_default=True, help="HTTP address"),
    click.option(
        "--api-key",
        default=None,
        help="bearer key the HTTP /v1/ routes require (required off loopback)",
    ),
    click.option(
        "--api-key-file",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="file whose first line is the API key",
    ),
    click.option(
        "--max-body-mb", default=4.0, show_default=True, help="largest HTTP request body (MiB)"
    ),
)
