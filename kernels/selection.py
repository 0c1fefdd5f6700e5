"""Which attention backend a run builds (`select_attention_backend`), and why."""

from __future__ import annotations

import torch

from .backend import AttentionBackend
from .cpu_attention import CpuPagedAttention
from .cpu_attention_kernels import cpu_attention_available
from .flash_attn_backend import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    FlashAttnPagedAttention,
    flash_attn_available,
)
from .torch_attention import TorchPagedAttention
from .triton_backend import TritonPagedAttention, triton_available

_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_misfit(kv_cache_dtype: str, block_size: int, dtype: torch.dtype | None) -> str | None:
    """Why the triton backend cannot serve this configuration, or None when it can."""
    if kv_cache_dtype == "int8":
        return "its kernels read float KV caches, not int8"
    if block_size < 1 or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    if dtype is not None and dtype not in _TRITON_DTYPES:
        return f"dtype {dtype} is not float32/bfloat16/float16"
    return None


def _flash_misfit(
    flash_attn_ok: bool, kv_cache_dtype: str, block_size: int, dtype: torch.dtype | None
) -> str | None:
    """Why `auto` does not take flash_attn on a CUDA device, or None when it does."""
    if kv_cache_dtype == "int8":
        return "int8 KV cache"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"block_size {block_size} is not a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not float16/bfloat16"
    if not flash_attn_ok:
        return "flash-attn does not import"
    return None


def choose_attention_backend(
    requested: str,
    device_type: str,
    *,
    flash_attn_ok: bool,
    triton_ok: bool,
    cpu_ok: bool,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    dtype: torch.dtype | None = None,
) -> tuple[str, str]:
    """Which attention backend to build, and one line saying why (printed at startup).

    Pure: the probes come in as flags (flash_attn_ok: flash-attn imports; triton_ok:
    `triton_available` on this device; cpu_ok: the native CPU kernel builds), so the
    choice can be tested for any device without its hardware.

    "auto": flash_attn on CUDA when it imports, block_size is a multiple of 256, dtype
    (if given) is fp16/bf16 and the KV cache is not int8; else triton on CUDA where it
    imports and fits; else cpu on a CPU where the native kernel builds; else torch. An
    explicit name is returned as is, or ValueError says why it cannot run here (for
    "flash_attn" the package check is left to the backend, which raises ImportError).
    """
    if requested == "torch":
        return "torch", "attention torch (requested)"
    if requested == "cpu":
        if device_type != "cpu":
            raise ValueError(f"cpu attention backend needs a CPU device, got {device_type}")
        if not cpu_ok:
            raise ValueError(
                "cpu attention backend: the native kernel could not be built (no working C "
                "compiler, or SARAZMQ_NATIVE=0); use --attention-backend torch"
            )
        return "cpu", "attention cpu (requested)"
    if requested == "flash_attn":
        if kv_cache_dtype == "int8":
            raise ValueError(
                "the flash_attn attention backend reads fp16/bf16 KV caches, not int8; "
                "use --attention-backend torch"
            )
        if device_type != "cuda":
            raise ValueError(f"flash_attn attention backend needs a CUDA device, got {device_type}")
        return "flash_attn", "attention flash_attn (requested)"
    if requested == "triton":
        misfit = _triton_misfit(kv_cache_dtype, block_size, dtype)
        if misfit is not None:
            raise ValueError(f"triton attention backend: {misfit}; use --attention-backend torch")
        if not triton_ok:
            if device_type == "cuda":
                raise ValueError(
                    "triton attention backend: the triton package could not be imported "
                    "(pip install triton); use --attention-backend torch"
                )
            raise ValueError(
                f"triton attention backend needs a CUDA device, got {device_type} (on a CPU "
                "it runs only under Triton's interpreter, TRITON_INTERPRET=1, for tests); "
                "use --attention-backend torch or cpu"
            )
        return "triton", "attention triton (requested)"
    if requested != "auto":
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {_BACKENDS}")
    if device_type == "cuda":
        no_flash = _flash_misfit(flash_attn_ok, kv_cache_dtype, block_size, dtype)
        if no_flash is None:
            return "flash_attn", "attention flash_attn (auto: CUDA, flash-attn imports)"
        no_triton = _triton_misfit(kv_cache_dtype, block_size, dtype)
        if no_triton is None and not triton_ok:
            no_triton = "triton does not import"
        if no_triton is None:
            return "triton", f"attention triton (auto: CUDA, not flash_attn: {no_flash})"
        return "torch", (
            f"attention torch (auto: CUDA, not flash_attn: {no_flash}; not triton: {no_triton})"
        )
    if device_type == "cpu":
        if cpu_ok:
            return "cpu", "attention cpu (auto: CPU, native kernel built)"
        return "torch", "attention torch (auto: CPU, native kernel not built)"
    return "torch", f"attention torch (auto: {device_type} device)"


def select_attention_backend_with_reason(
    name: str,
    device: torch.device | str,
    block_size: int,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[AttentionBackend, str]:
    """`select_attention_backend`, plus the one-line reason for the startup output.

    Probes only what the request can use: flash-attn and triton imports on CUDA (triton
    also when asked for by name), the native CPU kernel build on a CPU.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    chosen, reason = choose_attention_backend(
        name,
        device.type,
        flash_attn_ok=name == "auto" and cuda and flash_attn_available(),
        # `auto` never takes triton off CUDA (the interpreter is for tests)
        triton_ok=(name == "triton" or (name == "auto" and cuda)) and triton_available(device),
        cpu_ok=name in ("auto", "cpu") and device.type == "cpu" and cpu_attention_available(),
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        dtype=dtype,
    )
    if chosen == "flash_attn":
        return FlashAttnPagedAttention(block_size), reason
    if chosen == "triton":
        return TritonPagedAttention(block_size), reason
    if chosen == "cpu":
        return CpuPagedAttention(), reason
    return TorchPagedAttention(), reason


def select_attention_backend(
    name: str,
    device: torch.device | str,
    block_size: int,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """Returns an attention backend instance (`choose_attention_backend` says which).

    name: "auto" -> flash_attn, else triton on CUDA, else cpu on a CPU where the native
    kernel builds, else torch (see `choose_attention_backend`). "torch" ->
    TorchPagedAttention. "cpu" -> CpuPagedAttention (ValueError off CPU or when the
    kernel cannot be built). "flash_attn" -> FlashAttnPagedAttention, raising ValueError
    (not CUDA, bad block size, int8 KV cache) or ImportError (package missing).
    "triton" -> TritonPagedAttention, raising ValueError when triton does not import,
    the device is neither CUDA nor under TRITON_INTERPRET=1, block_size is not a power
    of two, or the KV cache is int8.
    """
    return select_attention_backend_with_reason(name, device, block_size, dtype, kv_cache_dtype)[0]
