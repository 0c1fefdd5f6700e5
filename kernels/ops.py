"""Plain PyTorch hot ops of the Llama family: RMSNorm (with fused residual add) and RoPE.

Both follow Hugging Face transformers' Llama numerics exactly (same float32 upcast points,
same operation order), so that our model matches the reference implementation to rounding.
"""

from __future__ import annotations

import math

import torch

from sarazmq.config import RopeScaling


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add.

    x: [..., hidden], weight: [hidden], residual: None or like x.
    Returns (out, new_residual): new_residual = x + residual (or x when residual is None) is
    the pre-norm stream the next block adds its output to; out = RMSNorm(new_residual).
    The reduction runs in float32 and the result is cast back before the weight multiply,
    as transformers' LlamaRMSNorm does.
    """
    if residual is not None:
        # same operand order as the reference (residual + hidden)
        x = residual + x
    new_residual = x
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)  # [..., 1]
    normed = xf * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype), new_residual


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for RoPE, with optional scaling.

    kinds: None / "default" / "dynamic" (dynamic NTK only differs past the original
    context, which we do not extend; treated as none), "linear" (positions divided by
    factor) and "llama3" (matches transformers' `_compute_llama3_parameters`).
    """
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
    # same expression as transformers (int64 arange cast to float32, then / dim)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling is None or scaling.kind in ("default", "dynamic"):
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        factor = scaling.factor
        low = scaling.low_freq_factor
        high = scaling.high_freq_factor
        old_context_len = scaling.original_max_position
        if high <= low:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor ({high}) > low_freq_factor ({low})"
            )
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept; in between a
        # smooth interpolation (continuous at both ends)
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope scaling kind {scaling.kind!r}")


def build_rope_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """cos/sin table [max_position, head_dim] float32: [:, :D/2] = cos, [:, D/2:] = sin.

    Row p holds the angles p * inv_freq computed in float32 exactly as transformers does
    (position as float32 times inv_freq), so the cached values are bit-identical to its
    on-the-fly computation.
    """
    if max_position < 1:
        raise ValueError(f"max_position={max_position} must be >= 1")
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [D/2]
    pos = torch.arange(max_position, dtype=torch.float32, device=device)  # [P]
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, D]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D/2]. Equals x*cat(cos,cos) + rotate_half(x)*cat(sin,sin)
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, HF non-interleaved (rotate_half) convention.

    q: [T, H, D], k: [T, Hkv, D], positions: [T] int, cos_sin_cache: [P, D] from
    `build_rope_cache`. Returns new (q, k) of the input dtype; cos/sin are cast to that
    dtype first, as transformers does.
    """
    half = q.shape[-1] // 2
    if cos_sin_cache.shape[-1] != 2 * half:
        raise ValueError(
            f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} != head_dim {q.shape[-1]}"
        )
    cs = cos_sin_cache.index_select(0, positions.to(torch.long))  # [T, D]
    cos = cs[:, None, :half].to(q.dtype)  # [T, 1, D/2]
    sin = cs[:, None, half:].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))
