"""What the model needs from an attention backend: one protocol every backend satisfies.

A backend (`TorchPagedAttention`, `CpuPagedAttention`, `FlashAttnPagedAttention`) gives
the model three things: paged attention for a hybrid batch (`forward`), the ops for the
rest of a layer (`ops`: RMSNorm, RoPE, SiLU-and-multiply, matmuls on `LinearWeight`s),
and optionally a whole decode step or hybrid iteration in one call (`fused_decode_step`,
`hybrid_step`), which a backend without one answers with None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .cpu_ops import HotOps
from .decode_step import DecodeLayerWeights, FusedDecodeStep, StepSizes
from .hybrid_step import HybridStep
from .metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    """The interface `LlamaForCausalLM` runs on (see module docstring)."""

    name: str
    ops: HotOps
    # True where a decode-only batch's attention reads nothing but the metadata's tensors
    # (no host lists, no host syncs), so its forward pass can be captured in a CUDA graph
    # and replayed on new inputs (`sarazmq.worker.cuda_graphs`)
    cuda_graph_safe: bool

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
        """Writes this step's k/v into the paged caches, then attends.

        q: [T, H, D]; k, v: [T, Hkv, D] (packed like q: decodes first, then prefill
        chunks); k_cache, v_cache: [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        """
        ...

    def fused_decode_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> FusedDecodeStep | None:
        """A Llama model's whole decode step over these weights and caches in one call
        (`sarazmq.kernels.decode_step`), running the kernels `forward` and `ops` run op by
        op; None where the backend has none or cannot build it for these tensors.

        layers: per layer, its weights (a matmul as its plain tensor or its quantized
        blocks); final_norm: [hidden]; kv_caches: per layer (k_cache, v_cache); sizes: the
        model's head counts, head size, norm epsilon and attention scale.
        """
        ...

    def hybrid_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> HybridStep | None:
        """A Llama model's whole hybrid iteration over these weights and caches in one call
        (`sarazmq.kernels.hybrid_step`), running the kernels `forward` and `ops` run op by
        op; None where the backend has none or cannot build it for these tensors.

        layers: per layer, its norms and each matmul's AMX tile layout
        (`LinearWeight.tiles`); final_norm: [hidden]; kv_caches: per layer (k_cache,
        v_cache).
        """
        ...
