"""Resolving an `EngineConfig` once, before any process starts: device, context, KV pool size."""

from __future__ import annotations

import dataclasses
import os

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.kernels.int8_isa import int8_dot_avx2, int8_dot_vnni
from sarazmq.kernels.native import cpu_has_flag, cpu_isa_cap
from sarazmq.model.model_config import load_model_config
from sarazmq.model.partition import check_pipeline_parallel, kv_cache_bytes_per_block, stage_layers
from sarazmq.model.source import resolve_model

#: device nodes of the GPU drivers torch.cuda runs on (NVIDIA; AMD's ROCm; WSL's GPU):
#: where none exists CUDA cannot be available, and "auto" is the CPU without importing
#: torch (seconds of a deployment's start, before any process is spawned)
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    """Whether any of the GPU drivers' device nodes exists (`GPU_DEVICE_NODES`)."""
    return any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def available_memory_bytes(device: str) -> int:
    """Free memory where the KV cache will live."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_device(device: str) -> str:
    """ "auto" is cuda where CUDA is available, else cpu; a cuda device needs CUDA."""
    if device == "auto" and not gpu_driver_present():
        return "cpu"
    if device == "auto" or device.startswith("cuda"):
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            raise ValueError(f"device={device!r} requested but CUDA is not available")
    return device


def native_bf16(device: str) -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA GPU with bf16 support, or a CPU
    with AMX-BF16 or AVX512-BF16 (elsewhere bf16 matmuls are emulated, slower than float32)."""
    if device.startswith("cuda"):
        import torch

        return bool(torch.cuda.is_bf16_supported())
    return cpu_has_flag("amx_bf16") or cpu_has_flag("avx512_bf16")


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype a run uses: `dtype` itself unless "auto", which is bfloat16 where the
    device computes it natively and float32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def describe_dtype_choice(requested: str, resolved: str) -> str:
    """The dtype in use and why, for startup output."""
    if requested != "auto":
        return f"dtype {resolved}"
    why = "native bf16 on this device" if resolved == "bfloat16" else "no native bf16 here"
    return f"dtype {resolved} (auto: {why})"


def resolve_gguf_matmul(mode: str, model_kind: str, device: str, dtype: str) -> str:
    """How a model's GGUF blocks are multiplied: `mode` itself unless "auto", which is
    "int8" for a GGUF model in float32 on a CPU where the int8 kernels were measured faster
    than the float32 path (docs/KERNELS.md): AVX2 ones without AVX-512 (float FMAs as wide
    as the integer ones), or ones built with VPDPBUSD (AVX512-VNNI / AVX-VNNI); else
    "float" (AVX-512 without VNNI was not measured; bf16 runs the float path). ValueError
    for "int8" asked where nothing would take it (not a GGUF model in float32 on the CPU)."""
    if mode == "int8" and (model_kind != "gguf" or device != "cpu" or dtype != "float32"):
        raise ValueError(
            "gguf_matmul='int8' takes a GGUF model in float32 on the CPU; got a "
            f"{model_kind} model, dtype {dtype} on {device} (use --dtype float32, or "
            "--gguf-matmul auto/float)"
        )
    if mode != "auto":
        return mode
    fits = (
        model_kind == "gguf"
        and device == "cpu"
        and dtype == "float32"
        and int8_dot_avx2()
        and (int8_dot_vnni() or not cpu_has_flag("avx512f"))
    )
    return "int8" if fits else "float"


def describe_dtype(requested: EngineConfig, resolved: EngineConfig) -> str:
    """The startup line's part on numerics: the dtype in use and why, the GGUF matmuls
    where they are int8, and the CPU instruction-set cap where one is set."""
    out = describe_dtype_choice(requested.dtype, resolved.dtype)
    if resolved.gguf_matmul == "int8":
        why = (
            " (auto: float32 here; --gguf-matmul float for the float path)"
            if requested.gguf_matmul == "auto"
            else ""
        )
        out += f", GGUF matmuls int8{why}"
    if resolved.device == "cpu" and (cap := cpu_isa_cap()) != "native":
        out += f", CPU kernels capped at {cap} (SARAZMQ_CPU_ISA)"
    return out


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, ModelConfig]:
    """Fills in device, max_model_len and the KV pool size; checks tensor-parallel fit.

    Returns the resolved config (no field left on "auto"/0, dtype included) and the
    model's architecture.
    """
    source = resolve_model(config.model, config.load_format)
    model_config = load_model_config(source)
    tp = config.tensor_parallel_size
    for name, heads in (
        ("num_heads", model_config.num_heads),
        ("num_kv_heads", model_config.num_kv_heads),
    ):
        if heads % tp != 0:
            raise ValueError(
                f"--tp {tp} does not divide the model's {name}={heads}: tensor parallelism "
                f"splits attention heads evenly across ranks"
            )
    pp = config.pipeline_parallel_size
    check_pipeline_parallel(model_config.num_layers, pp)
    device = resolve_device(config.device)
    if device == "cpu":
        cpu_isa_cap()  # a bad SARAZMQ_CPU_ISA fails here, before any process starts

    dtype = resolve_dtype(config.dtype, device)

    sched = config.scheduler
    max_len = sched.max_model_len or model_config.max_position
    if max_len > model_config.max_position:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's context of {model_config.max_position}"
        )
    cache = config.cache
    block_size = cache.block_size
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    num_blocks = cache.num_blocks
    if num_blocks <= 0:
        # the first pipeline stage holds the most layers (see stage_layers)
        stage_layer_count = len(stage_layers(model_config.num_layers, pp, 0))
        per_block = kv_cache_bytes_per_block(
            model_config,
            block_size,
            dtype,
            tp,
            stage_layer_count,
            kv_cache_dtype=cache.kv_cache_dtype,
        )
        budget = available_memory_bytes(device) * cache.memory_fraction
        # every rank holds 1/tp of each block of its stage's layers; budget is per device
        # on CUDA (each instance's ranks have their own devices), shared on CPU by all
        # tp x pp ranks of every instance (data-parallel replicas, prefill and decode
        # instances; on several machines this is conservative: a node runs some of them)
        if not device.startswith("cuda"):
            budget /= tp * pp * config.num_instances
        by_memory = int(budget // per_block)
        # no point in more than every running request at full context
        by_need = sched.max_num_seqs * -(-max_len // block_size) + 1
        num_blocks = max(1, min(by_memory, by_need))
    resolved = dataclasses.replace(
        config,
        device=device,
        dtype=dtype,
        gguf_matmul=resolve_gguf_matmul(config.gguf_matmul, source.kind, device, dtype),
        scheduler=dataclasses.replace(sched, max_model_len=max_len),
        cache=dataclasses.replace(cache, num_blocks=num_blocks),
    )
    return resolved, model_config
