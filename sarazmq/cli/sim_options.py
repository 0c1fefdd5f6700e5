"""What the simulating commands share (`simulate`, `capacity --simulate`, `sweep --simulate`):
the latency source options, the scheduling options, and the simulated engine's geometry.

- `latency_source_options(tp=...)`: --profile, or --gpu and --arch (plus --tp when the
  command has no engine --tp of its own), and --overhead-ms.
- `sim_scheduling_options`: the engine options that shape scheduling (--scheduler,
  --chunk-size, --tbt-slo, --max-num-seqs, --block-size, --num-kv-blocks, --max-model-len,
  --prefix-caching, --seed), named as `engine_options` names them so one option dict
  serves both.
- `load_latency(kw)`, `sim_vocabulary(kw, info)`, `sim_geometry(kw, info, requests)`,
  `sim_settings(...)`, `sim_engine_line(...)`: what the commands do with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

from sarazmq.cli.options import policy_options, stack
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sim.simulator import SimOutcome

#: vocabulary of the prompts when nothing says otherwise (Llama-2 / Mistral's)
DEFAULT_SIM_VOCAB = 32000
#: share of GPU memory the engine may use (vLLM's default gpu_memory_utilization)
GPU_MEMORY_UTILIZATION = 0.9
#: bytes per weight and KV element on a GPU (bf16)
GPU_ELEM_BYTES = 2


def latency_source_options(*, tp: bool) -> Any:
    """--profile | --gpu + --arch, --overhead-ms; with tp=True also --tp (a command with
    engine options has its own --tp, read under "tensor_parallel_size")."""
    opts = [
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
    ]
    if tp:
        opts.append(
            click.option(
                "--tp", "tensor_parallel_size", default=1, show_default=True, help="GPUs per model"
            )
        )
    opts.append(
        click.option(
            "--overhead-ms",
            type=float,
            default=None,
            help="added to every simulated iteration (ms; default: the gap between "
            "iterations a `profile --from-runs` measured, else 0)",
        )
    )
    return stack(*opts)


#: The engine options that shape scheduling, for commands that simulate only.
sim_scheduling_options = stack(
    policy_options,
    click.option(
        "--num-kv-blocks",
        default=0,
        show_default=True,
        help="KV pool size in blocks (0 = the profile's engine pool, or GPU memory minus weights)",
    ),
    click.option(
        "--max-model-len",
        default=0,
        show_default=True,
        help="longest prompt+output (0 = the profiled model's context, else the workload's longest)",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="workload and engine seed"),
)


def load_latency(kw: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(latency model, where it came from) for the latency source options; one-line click
    errors for a bad combination, name or file."""
    from sarazmq.perf.load import load_latency_model

    if kw["overhead_ms"] is not None and kw["overhead_ms"] < 0:
        raise click.BadParameter("must be >= 0", param_hint="--overhead-ms")
    try:
        model, info = load_latency_model(
            kw["profile"], kw["gpu"], kw["arch"], int(kw.get("tensor_parallel_size") or 1)
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


def gpu_kv_blocks(gpu: str, arch: str, tp: int, block_size: int) -> int:
    """KV blocks per engine on `tp` GPUs: each GPU's memory x GPU_MEMORY_UTILIZATION less
    its share of the bf16 weights, divided by its share of a block's K and V."""
    from sarazmq.perf.architectures import get_architecture, get_gpu
    from sarazmq.perf.cost import ModelCost

    g, cost = get_gpu(gpu), ModelCost.from_architecture(get_architecture(arch), GPU_ELEM_BYTES, tp)
    free = g.memory_bytes * GPU_MEMORY_UTILIZATION - cost.weight_bytes
    if free <= 0:
        raise ValueError(
            f"{arch} does not fit {tp} x {gpu}: {cost.weight_bytes / 1e9:.1f} GB of weights "
            f"per GPU (use a larger --tp)"
        )
    return int(free // (cost.kv_bytes_per_token * block_size))


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
            try:
                num_blocks = gpu_kv_blocks(kw["gpu"], kw["arch"], tp, block_size)
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


def sim_engine_line(kw: Mapping[str, Any], policy: str, geometry: Mapping[str, int]) -> str:
    """The simulated engine in one line (printed before each run)."""
    slo = f"tbt slo: {kw['tbt_slo']} s  " if kw.get("tbt_slo") else ""
    return (
        f"simulated engine: scheduler: {policy}  chunk: {kw['chunk_size']}  {slo}"
        f"max_num_seqs: {kw['max_num_seqs']}  kv blocks: {geometry['num_blocks']} x "
        f"{geometry['block_size']}  max_model_len: {geometry['max_model_len']}  prefix "
        f"caching: {'on' if kw['enable_prefix_caching'] else 'off'}"
    )


def latency_line(info: Mapping[str, Any]) -> str:
    src = info.get("source", "?")
    if src == "profile":
        return f"latency model: profile {info.get('path')}"
    what = f"{info.get('gpu')} x{info.get('tp', 1)}, {info.get('arch')}"
    return f"latency model: {src} ({what})"


def sim_settings(
    kw: Mapping[str, Any],
    policy: str,
    geometry: Mapping[str, int],
    latency_info: Mapping[str, Any],
    out: SimOutcome,
) -> dict[str, Any]:
    """The run's settings for summary.json: simulated, the engine it stood for, the latency
    model's source, and the simulation's own wall time."""
    return {
        "simulated": True,
        "latency_model": dict(latency_info),
        "engine": {
            "scheduler": {
                "policy": policy,
                "chunk_size": kw["chunk_size"],
                "tbt_slo": kw.get("tbt_slo") or 0.0,
                "max_num_seqs": kw["max_num_seqs"],
                "max_model_len": geometry["max_model_len"],
            },
            "cache": {
                "block_size": geometry["block_size"],
                "num_blocks": geometry["num_blocks"],
                "enable_prefix_caching": kw["enable_prefix_caching"],
            },
            "seed": kw["seed"],
        },
        "sim_wall_s": out.wall_s,
        "sim_time_s": out.sim_time_s,
        "num_iterations": out.num_iterations,
    }
