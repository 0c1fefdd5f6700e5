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
    return _rms(x, weight, eps), x


def rms_norm_(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` that adds x into `residual` in place (no new residual tensor).

    Same values as `rms_norm` (addition is commutative in IEEE arithmetic); for the
    model's hot loop, where the residual stream is a tensor the model owns.
    """
    if residual is not None:
        x = residual.add_(x)
    return _rms(x, weight, eps), x


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, operation for operation (float32 reduction, cast back
    # before the weight multiply), with the intermediates updated in place
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)  # [..., 1]
    normed = xf * torch.rsqrt(variance.add_(eps))
    if normed.dtype != x.dtype:
        normed = normed.to(x.dtype)
    if weight.dtype == normed.dtype and weight.shape == normed.shape[-1:]:
        return normed.mul_(weight)  # == weight * normed, without a new tensor
    return weight * normed


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


def rope_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rotation tables for `apply_rope_`, built once per forward pass.

    positions: [T] int; cos_sin_cache: [P, D] float32 from `build_rope_cache`.
    Returns (cos, sin_signed), each [T, 1, D] in `dtype`: cos = cat(cos, cos) and
    sin_signed = cat(-sin, sin), cast to `dtype` first as transformers does.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.to(torch.long)).to(dtype)  # [T, D]
    cos, sin = cs[:, :half], cs[:, half:]
    cos_full = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
    sin_signed = torch.cat((-sin, sin), dim=-1).unsqueeze(1)  # [T, 1, D]
    return cos_full, sin_signed


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place (HF rotate_half convention); returns x.

    x: [T, heads, D], any strides with a unit last stride (e.g. the q and k heads of one
    fused qkv projection output, rotated together); cos, sin_signed: [T, 1, D] from
    `rope_cos_sin`. Computes x * cos + rotate_half(x) * sin with the same roundings as
    transformers: rotate_half(x) * sin = cat(-x2, x1) * cat(sin, sin)
    = cat(x2, x1) * cat(-sin, sin), and negation is exact.
    """
    half = x.shape[-1] // 2
    swapped = torch.roll(x, half, dims=-1)  # cat(x2, x1), a new tensor
    swapped.mul_(sin_signed)
    return x.mul_(cos).add_(swapped)


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
    cos, sin = rope_cos_sin(positions, cos_sin_cache, q.dtype)
    q_out = apply_rope_(q.clone(), cos, sin)
    if k.dtype != q.dtype:
        cos, sin = cos.to(k.dtype), sin.to(k.dtype)
    return q_out, apply_rope_(k.clone(), cos, sin)


# ---------------------------------------------------------------------------- linear


def can_prepack_linear(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `prepack_linear` applies: bf16 or float32 on a CPU with oneDNN (mkldnn).

    For bf16 on CPU, `F.linear` goes through oneDNN and reorders the weight into its
    blocked layout on every call; prepacking once saves that, with bit-identical results.
    float32 `F.linear` goes to MKL, which on AMD CPUs is slower than oneDNN's packed matmul
    for the model's shapes; the float32 sums then run in another order (differences
    ~1e-6 relative). Measurements: docs/KERNELS.md, "Prepacked matmul weights".
    """
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        # oneDNN's bf16 reorder refuses CPUs without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        and (dtype != torch.bfloat16 or _onednn_bf16_supported())
    )


def _onednn_bf16_supported() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is None or bool(probe())


def prepack_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor for `linear(..., packed=)` (a copy: it
    does not keep `weight` alive or read it later)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` ([..., in] -> [..., out]), through the prepacked
    weight when one is given (same values, see `can_prepack_linear`); weight may then be
    None (not read). Raises ValueError when neither is given."""
    if packed is None:
        if weight is None:
            raise ValueError("linear: neither a weight nor a packed weight")
        return torch.nn.functional.linear(x, weight, bias)
    if x.dim() != 2:
        out = linear(x.reshape(-1, x.shape[-1]), weight, bias, packed)  # [N, out]
        return out.view(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
