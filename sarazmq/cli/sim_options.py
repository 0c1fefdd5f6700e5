"""What the simulating commands share (`simulate`, `capacity --simulate`, `sweep --simulate`):
the latency source options, and the simulated engine built from the engine's own options.

- `latency_source_options`: --profile, or --gpu and --arch, --pp-link-gbs, and
  --overhead-ms (--tp and --pp are engine options: `simulate` takes them from
  `sim_engine_options`, the others from `engine_options`).
- `load_latency(kw)`, `sim_vocabulary(kw, info)`, `sim_geometry(kw, info, requests)`,
  `sim_config(kw, info, requests)` (the resolved `EngineConfig`: the engine options of
  the command, through `EngineOptions`, with the derived KV pool and context),
  `sim_engine_line(config)`: what the commands do with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

from sarazmq.cli.options import engine_options_of, stack
from sarazmq.config import EngineConfig
from sarazmq.perf.pipeline import DEFAULT_PP_LINK_BANDWIDTH
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sim.run import sim_engine_config

#: vocabulary of the prompts when nothing says otherwise (Llama-2 / Mistral's)
DEFAULT_SIM_VOCAB = 32000
#: share of GPU memory the engine may use (vLLM's default gpu_memory_utilization)
GPU_MEMORY_UTILIZATION = 0.9
#: bytes per weight and KV element on a GPU (bf16)
GPU_ELEM_BYTES = 2


def latency_source_options(f: Any) -> Any:
    """--profile | --gpu + --arch, --pp-link-gbs, --overhead-ms."""
    return stack(
        click.option(
            "--profile",
            default=None,
            type=click.Path(dir_okay=False),
            help="latency model: a `sarazmq profile --output` JSON (this machine's engine)",
        ),
        click.option(
            "--gpu", default=None, help="latency model of a named GPU (with --arch): a100, h100"
        ),
        click.option(
            "--arch", default=None, help="the model architecture for --gpu, e.g. mistral-7b"
        ),
        click.option(
            "--pp-link-gbs",
            type=float,
            default=DEFAULT_PP_LINK_BANDWIDTH / 1e9,
            show_default=True,
            help="GB/s between consecutive pipeline stages (default: a 200 Gb/s InfiniBand "
            "port per GPU, stages on two nodes; NVLink within a node: 300 on A100)",
        ),
        click.option(
            "--overhead-ms",
            type=float,
            default=None,
            help="added to every simulated iteration (ms; default: the gap between "
            "iterations a `profile --from-runs` measured, else 0)",
        ),
    )(f)


def load_latency(kw: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(latency model, where it came from) for the latency source options; one-line click
    errors for a bad combination, name or file."""
    from sarazmq.perf.load import load_latency_model

    if kw["overhead_ms"] is not None and kw["overhead_ms"] < 0:
        raise click.BadParameter("must be >= 0", param_hint="--overhead-ms")
    try:
        model, info = load_latency_model(
            kw["profile"],
            kw["gpu"],
            kw["arch"],
            int(kw.get("tensor_parallel_size") or 1),
            pp=int(kw.get("pipeline_parallel_size") or 1),
            pp_link_bandwidth=float(kw.get("pp_link_gbs") or DEFAULT_PP_LINK_BANDWIDTH / 1e9) * 1e9,
        )
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    overhead_s = (
        kw["overhead_ms"] / 1e3 if kw["overhead_ms"] is not None else info.get("overhead_s", 0.0)
    )
    return model, {**info, "overhead_s": float(overhead_s)}


def _profile_engine(info: Mapping[str, Any]) -> Mapping[str, Any]:
    """The profiled engine's facts (`sarazmq profile` writes block_size, num_kv_blocks,
    model, ...); empty for a GPU model."""
    engine = info.get("engine")
    return engine if isinstance(engine, Mapping) else {}


def _profile_model_config(info: Mapping[str, Any]) -> Any:
    """The profiled engine's ModelConfig when its model is on this machine, else None
    (only its config is read: vocabulary and context)."""
    name = _profile_engine(info).get("model")
    if not name:
        return None
    from sarazmq.model.loader import load_model_config, resolve_model

    try:
        return load_model_config(resolve_model(str(name)))
    except Exception:  # noqa: BLE001 - a missing or odd model only loses the defaults
        return None


def sim_vocabulary(kw: Mapping[str, Any], info: Mapping[str, Any]) -> tuple[int, str]:
    """(vocab_size, avoid_ids) for the prompts: --vocab-size, else the profiled engine's
    model's vocabulary (when its model is here), else 32000; --avoid-ids 'auto' (the
    model tokenizer's specials) means none here: prompt ids only matter to the prefix
    cache."""
    vocab = int(kw["vocab_size"])
    if vocab <= 0:
        mc = _profile_model_config(info)
        vocab = mc.vocab_size if mc is not None else DEFAULT_SIM_VOCAB
    avoid = kw["avoid_ids"]
    return vocab, "" if avoid == "auto" else avoid


def gpu_kv_blocks(gpu: str, arch: str, tp: int, block_size: int, pp: int = 1) -> int:
    """KV blocks per engine on `tp` x `pp` GPUs: each GPU's memory x GPU_MEMORY_UTILIZATION
    less its share of the bf16 weights, divided by its share of a block's K and V (a
    stage holds its layers' weights and KV; the most loaded stage, with the LM head
    counted whole on it, sets the size)."""
    from sarazmq.perf.architectures import get_architecture, get_gpu
    from sarazmq.perf.cost import ModelCost
    from sarazmq.perf.pipeline import split_layers

    a = get_architecture(arch)
    g, cost = get_gpu(gpu), ModelCost.from_architecture(a, GPU_ELEM_BYTES, tp)
    share = max(split_layers(a.num_layers, pp)) / a.num_layers
    weights = (cost.linear_params * share + cost.head_params) * cost.elem
    if pp == 1:
        weights = cost.weight_bytes
    free = g.memory_bytes * GPU_MEMORY_UTILIZATION - weights
    if free <= 0:
        where = f"{tp} x {gpu}" if pp == 1 else f"{tp} x {pp} stages of {gpu}"
        raise ValueError(
            f"{arch} does not fit {where}: {weights / 1e9:.1f} GB of weights per GPU "
            f"(use a larger --tp or --pp)"
        )
    return int(free // (cost.kv_bytes_per_token * share * block_size))


def sim_geometry(
    kw: Mapping[str, Any], info: Mapping[str, Any], requests: Sequence[WorkloadRequest]
) -> dict[str, int]:
    """block_size, num_blocks and max_model_len of the simulated engine: the options, or
    derived (see their help). ClickException when the pool cannot be derived."""
    block_size = int(kw["block_size"])
    if block_size < 1:
        raise click.BadParameter("must be >= 1", param_hint="--block-size")
    engine = _profile_engine(info)
    num_blocks = int(kw["num_kv_blocks"])
    if num_blocks < 0:
        raise click.BadParameter("must be >= 0", param_hint="--num-kv-blocks")
    if num_blocks == 0:
        if kw.get("gpu") and kw.get("arch"):
            tp = int(kw.get("tensor_parallel_size") or 1)
            pp = int(kw.get("pipeline_parallel_size") or 1)
            try:
                num_blocks = gpu_kv_blocks(kw["gpu"], kw["arch"], tp, block_size, pp)
            except ValueError as e:
                raise click.ClickException(str(e)) from None
        elif engine.get("num_kv_blocks"):
            # the profiled pool's token capacity, in this run's block size
            tokens = int(engine["num_kv_blocks"]) * int(engine.get("block_size") or block_size)
            num_blocks = tokens // block_size
        else:
            raise click.ClickException(
                "the profile does not say its engine's KV pool size: give --num-kv-blocks"
            )
    max_model_len = int(kw["max_model_len"])
    if max_model_len < 0:
        raise click.BadParameter("must be >= 0", param_hint="--max-model-len")
    if max_model_len == 0:
        mc = _profile_model_config(info) if engine else None
        longest = max((r.input_tokens + r.output_tokens for r in requests), default=1)
        max_model_len = mc.max_position if mc is not None else longest
    return {
        "block_size": block_size,
        "num_blocks": max(1, num_blocks),
        "max_model_len": max_model_len,
    }


def refuse_several_instances(kw: Mapping[str, Any], what: str) -> None:
    """One-line click errors for engine options that make several instances (`--dp`,
    `--disaggregate`) in a command that simulates one engine (`what`)."""
    if kw.get("data_parallel_size", 1) != 1:
        raise click.BadParameter(
            f"{what} simulates one replica (a fleet: `sarazmq simulate --dp`)", param_hint="--dp"
        )
    if kw.get("disaggregate"):
        raise click.BadParameter(
            f"{what} simulates one co-located engine (prefill and decode instances: "
            "`sarazmq simulate --disaggregate P:D`, or scripts/disagg_grid.py)",
            param_hint="--disaggregate",
        )


def sim_config(
    kw: Mapping[str, Any], info: Mapping[str, Any], requests: Sequence[WorkloadRequest]
) -> EngineConfig:
    """The simulated engine's resolved config: the command's engine options through the
    one door (`EngineOptions`), with the KV pool and context of `sim_geometry`; its model
    is the architecture it stands for (--arch, or the profiled engine's). One-line click
    errors for a bad value."""
    geometry = sim_geometry(kw, info, requests)
    model = kw.get("arch") or str(_profile_engine(info).get("model") or "")
    options = engine_options_of(kw, model=model)
    try:
        return sim_engine_config(
            options, num_blocks=geometry["num_blocks"], max_model_len=geometry["max_model_len"]
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def sim_engine_line(config: EngineConfig) -> str:
    """The simulated engine in one line (printed before each run)."""
    sched, cache = config.scheduler, config.cache
    slo = f"tbt slo: {sched.tbt_slo} s  " if sched.tbt_slo else ""
    pp = config.pipeline_parallel_size
    stages = f"pp: {pp}  " if pp > 1 else ""
    return (
        f"simulated engine: scheduler: {sched.policy}  chunk: {sched.chunk_size}  {slo}{stages}"
        f"max_num_seqs: {sched.max_num_seqs}  kv blocks: {cache.num_blocks} x "
        f"{cache.block_size}  max_model_len: {sched.max_model_len}  prefix "
        f"caching: {'on' if cache.enable_prefix_caching else 'off'}"
    )


def latency_line(info: Mapping[str, Any]) -> str:
    src = info.get("source", "?")
    if src == "profile":
        return f"latency model: profile {info.get('path')}"
    what = f"{info.get('gpu')} x{info.get('tp', 1)}, {info.get('arch')}"
    pipe = info.get("pipeline")
    if isinstance(pipe, Mapping):
        what += (
            f"; {pipe['pp']} pipeline stages of {'/'.join(map(str, pipe['stage_layers']))} "
            f"layers, {pipe['link_bandwidth'] / 1e9:g} GB/s between them"
        )
    return f"latency model: {src} ({what})"


def sim_pipeline_line(p: Mapping[str, Any]) -> str:
    """The pipeline's bubble fraction and per-stage busy time (a summary's "pipeline",
    `PipelineStats.to_dict`) in one line."""
    busy = " ".join(f"{b:.3f}" for b in p["stage_busy_fraction"])
    return (
        f"pipeline: {p['pp']} stages  bubble fraction {p['bubble_fraction']:.3f}  stage busy "
        f"{busy} of {p['active_s']:.1f} s active  micro-batches {p['num_micro_batches']} "
        f"(at most {p['max_inflight']} in flight)"
    )


def fleet_line(f: Mapping[str, Any]) -> str:
    """A fleet run's replicas, router, prefix-cache hit rate and balance (a summary's
    "fleet", `FleetOutcome.fleet_summary`) in one line."""
    busy, reqs = f["busy_fraction"], f["requests_per_replica"]
    router = f["router"]
    what = (
        f"{router['prefill']} prefill + {router['decode']} decode instances"
        if "prefill" in router
        else f"{f['replicas']} replicas"
    )
    return (
        f"fleet: {what}  router {router['policy']}  prefix cache hit "
        f"{100 * f['prefix_hit_rate']:.1f} %  requests per replica {reqs['min']}-{reqs['max']}"
        f"  busy {busy['min']:.3f}-{busy['max']:.3f} (mean {busy['mean']:.3f})"
    )
