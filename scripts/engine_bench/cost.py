"""What a batch costs the model: matmul FLOPs and bytes read, for the roofline limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sarazmq import LLM
from sarazmq.kernels.decode_step import FUSED_MAX_ROWS_BLOCKS
from sarazmq.kernels.linear_weight import LinearWeight


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of a Llama-family model, from its config."""

    linear_params: int  # decoder-layer matmul weights (all layers)
    head_params: int  # lm head (the embedding when tied)
    num_layers: int
    q_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    elem: int  # bytes per element in the run dtype
    # weight bytes a decode step of at most `block_rows` sequences reads, where the model
    # reads the GGUF's quantized blocks there (None: every step reads run-dtype weights)
    block_weight_bytes: int | None = None
    block_rows: int = 0

    def flops(self, q_lens: list[int], k_lens: list[int], sampled: int) -> float:
        """Matmul FLOPs of a batch: linear layers, causal attention, lm head rows."""
        tokens = sum(q_lens)
        attn_pairs = 0  # (query, key) pairs inside the causal mask
        for q, k in zip(q_lens, k_lens):
            # query j sees k - q + j + 1 keys
            attn_pairs += q * (k - q) + q * (q + 1) // 2
        return (
            2 * self.linear_params * tokens
            + 4 * self.q_width * self.num_layers * attn_pairs
            + 2 * self.head_params * sampled
        )

    def bytes(self, k_lens: list[int]) -> float:
        """Bytes read: every weight once, plus the KV cache of every sequence."""
        kv = 2 * self.kv_width * self.num_layers * sum(k_lens) * self.elem
        if self.block_weight_bytes is not None and len(k_lens) <= self.block_rows:
            return self.block_weight_bytes + kv
        return (self.linear_params + self.head_params) * self.elem + kv


def model_cost(llm: LLM, dtype: torch.dtype) -> ModelCost:
    """The costs of the model `llm` serves, from its config and its matmul weights."""
    cfg = llm.engine.model_config
    weights = dict(llm.engine.runner.model.matmul_weights())
    head = weights.pop("lm_head")
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = None
    if any(w.blocks is not None for w in (*weights.values(), head)):
        # as a 1-row decode step reads them: blocks where the model has them, else the
        # run-dtype weight (the lm head reads its blocks up to GEMV_MAX_ROWS rows only;
        # 1 is the row that matters)
        block_bytes = sum(
            w.variant_bytes()["blocks"] if w.blocks is not None else _params(w) * elem
            for w in (*weights.values(), head)
        )
    return ModelCost(
        linear_params=sum(_params(w) for w in weights.values()),
        head_params=_params(head),
        num_layers=cfg.num_layers,
        q_width=cfg.num_heads * cfg.head_dim,
        kv_width=cfg.num_kv_heads * cfg.head_dim,
        elem=elem,
        block_weight_bytes=block_bytes,
        block_rows=FUSED_MAX_ROWS_BLOCKS[dtype] if block_bytes is not None else 0,
    )


def _params(weight: LinearWeight) -> int:
    return weight.out_features * weight.in_features
