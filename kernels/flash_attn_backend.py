"""Paged attention with flash-attn 2's varlen kernel (CUDA only).

flash-attn is imported lazily: this module imports fine without it (CPU machines), and
the backend only fails when constructed where the package is missing.

Constraints of flash-attn 2's paged KV path (`flash_attn_varlen_func(..., block_table=)`):
- the cache's page size (our block_size) must be a multiple of 256;
- fp16 / bf16 only; head_dim <= 256;
- causal masks are aligned bottom-right, which is exactly chunked-prefill semantics
  (query i of a chunk sits at position k_len - q_len + i).
With smaller blocks use the torch backend (`select_attention_backend("auto", ...)` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .cpu_ops import TORCH_OPS, HotOps
from .metadata import AttentionMetadata
from .torch_attention import write_kv_cache

if TYPE_CHECKING:
    from .decode_step import DecodeLayerWeights, FusedDecodeStep, StepSizes
    from .hybrid_step import HybridStep

# flash-attn 2 paged KV requires page_block_size % 256 == 0
FLASH_ATTN_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    """True when `flash_attn.flash_attn_varlen_func` can be imported."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA extension raising at import
        return False
    return True


def _load_varlen_func() -> Callable[..., Any]:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:
        raise ImportError(
            "the flash_attn attention backend needs the flash-attn package "
            f"(pip install flash-attn), which could not be imported: {exc}"
        ) from exc
    return flash_attn_varlen_func


class FlashAttnPagedAttention:
    """Paged attention through `flash_attn.flash_attn_varlen_func` with a block table."""

    name = "flash_attn"
    cuda_graph_safe = False  # not run under capture yet (max_seqlen_k is a host int)
    # the model's other ops: plain PyTorch (on CUDA: torch's kernels)
    ops: HotOps = TORCH_OPS

    def __init__(self, block_size: int) -> None:
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"flash_attn backend needs block_size % {FLASH_ATTN_BLOCK_MULTIPLE} == 0 "
                f"(flash-attn 2 paged KV page size), got block_size={block_size}; "
                "use the torch backend or a larger block size"
            )
        self.block_size = block_size
        self._varlen = _load_varlen_func()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Writes k/v to the caches, then attends. Shapes as `TorchPagedAttention.forward`.

        q: [T, H, D]; k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
        Returns [T, H, D].
        """
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash_attn backend supports float16/bfloat16, got {q.dtype}")
        if k_cache.shape[1] != self.block_size:
            raise ValueError(
                f"k_cache block size {k_cache.shape[1]} != backend block_size {self.block_size}"
            )
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        # FA2's paged varlen path reads each sequence's KV length from cu_seqlens_k
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens_k, 0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )

    def fused_decode_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> FusedDecodeStep | None:
        """None: decode steps run op by op here (see `AttentionBackend.fused_decode_step`)."""
        return None

    def hybrid_step(self, *args: Any, **kwargs: Any) -> HybridStep | None:
        """None: hybrid iterations run op by op here (see `AttentionBackend.hybrid_step`)."""
        return None
