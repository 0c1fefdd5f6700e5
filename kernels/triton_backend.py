"""Paged attention with the Triton kernels of `sarazmq.kernels.triton_attention` (CUDA).

Triton is imported lazily: this module imports fine without it, and the kernels module
(which decorates its kernels, compiled or interpreted per TRITON_INTERPRET at that
moment) is imported only when a backend is constructed. On a CPU the backend works only
under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from .cpu_ops import HotOps
from .metadata import AttentionMetadata

if TYPE_CHECKING:
    from .decode_step import DecodeLayerWeights, FusedDecodeStep, StepSizes
    from .hybrid_step import HybridStep


def triton_interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (Triton's own
    spelling of true: "1", "true", "on", "yes", any case)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def triton_available(device: torch.device | str) -> bool:
    """True when the triton package imports and its kernels can run on `device`: a CUDA
    device, or any device under the interpreter (TRITON_INTERPRET=1)."""
    if torch.device(device).type != "cuda" and not triton_interpreter_enabled():
        return False  # decided without paying for the import
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def _load_kernels(module: str = "triton_attention") -> ModuleType:
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except ImportError as exc:
        raise ImportError(
            "the triton attention backend needs the triton package (pip install triton), "
            f"which could not be imported: {exc}"
        ) from exc


class TritonPagedAttention:
    """Paged attention through Triton kernels: the KV write, decodes (GQA heads of one KV
    head per program) and prefill chunks against their paged context, one launch each.

    The model's RMSNorm, RoPE and SiLU-and-multiply are Triton kernels too, one launch
    each (`sarazmq.kernels.triton_ops`); matmuls are torch's (cuBLAS).
    """

    name = "triton"
    cuda_graph_safe = True  # decodes read only tensors: lengths, tables, slots
    ops: HotOps  # TRITON_OPS, set when the kernels are loaded

    def __init__(self, block_size: int | None = None) -> None:
        """block_size: the KV cache's, checked now (a power of two) when given."""
        self._kernels = _load_kernels()
        self.ops = _load_kernels("triton_ops").TRITON_OPS
        if block_size is not None:
            self._kernels.check_block_size(block_size)
        self.block_size = block_size

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
        if self.block_size is not None and k_cache.shape[1] != self.block_size:
            raise ValueError(
                f"k_cache block size {k_cache.shape[1]} != backend block_size {self.block_size}"
            )
        self._kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._kernels.paged_attention(q, k_cache, v_cache, meta, scale)

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
