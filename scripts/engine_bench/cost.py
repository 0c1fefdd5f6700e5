"""What a batch costs the model, for the roofline limits: the package's `ModelCost`
(sarazmq.perf.cost) with the weights counted from the loaded model, plus what only this
benchmark needs (the GGUF's quantized blocks a small decode step reads instead)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sarazmq import LLM
from sarazmq.kernels.decode_step import FUSED_MAX_ROWS_BLOCKS
from sarazmq.kernels.linear_weight import LinearWeight
from sarazmq.perf.cost import ModelCost as IterationCost
from sarazmq.scheduler import IterationShape, chunk_attention_pairs


@dataclass(frozen=True)
class ModelCost:
    """The package's per-iteration costs, taking a batch as (query, key) lengths."""

    base: IterationCost
    # weight bytes a decode step of at most `block_rows` sequences reads, where the model
    # reads the GGUF's quantized blocks there (None: every step reads run-dtype weights)
    block_weight_bytes: int | None = None
    block_rows: int = 0
    # K and V bytes of one position, all layers, as the engine's cache holds them (int8
    # rows: D bytes and a 4-byte scale; None: the run dtype's)
    kv_token_bytes: float | None = None

    @property
    def linear_params(self) -> int:
        return self.base.linear_params

    @property
    def head_params(self) -> int:
        return self.base.head_params

    @property
    def elem(self) -> int:
        return self.base.elem

    def flops(self, q_lens: list[int], k_lens: list[int], sampled: int) -> float:
        """Matmul FLOPs of a batch: linear layers, causal attention, lm head rows."""
        pairs = sum(chunk_attention_pairs(k - q, q) for q, k in zip(q_lens, k_lens))
        shape = IterationShape(
            num_prefill_tokens=sum(q_lens),
            num_prefill_seqs=len(q_lens),
            prefill_attention_pairs=pairs,
            num_sampled=sampled,
        )
        return self.base.flops(shape)

    def bytes(self, k_lens: list[int]) -> float:
        """Bytes read: every weight once, plus the KV cache of every sequence."""
        per_token = (
            self.base.kv_bytes_per_token if self.kv_token_bytes is None else self.kv_token_bytes
        )
        kv = per_token * sum(k_lens)
        if self.block_weight_bytes is not None and len(k_lens) <= self.block_rows:
            return self.block_weight_bytes + kv
        return self.base.weight_bytes + kv


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
    base = IterationCost(
        linear_params=sum(_params(w) for w in weights.values()),
        head_params=_params(head),
        num_layers=cfg.num_layers,
        q_width=cfg.num_heads * cfg.head_dim,
        kv_width=cfg.num_kv_heads * cfg.head_dim,
        elem=elem,
    )
    # [num_blocks, block_size, Hkv, row] per layer, K and V
    kv_token_bytes = sum(
        t[0, 0].numel() * t.element_size() for pair in llm.engine.runner.kv_caches for t in pair
    )
    return ModelCost(
        base=base,
        block_weight_bytes=block_bytes,
        block_rows=FUSED_MAX_ROWS_BLOCKS[dtype] if block_bytes is not None else 0,
        kv_token_bytes=float(kv_token_bytes),
    )


def _params(weight: LinearWeight) -> int:
    return weight.out_features * weight.in_features
