"""Reading GGUF files' weights into the model (their architecture: `model_config`): the
weights dequantized and named as in Hugging Face checkpoints, and the blocks the decode
kernels read as stored.

- weights are dequantized to float32 (Q4_0 / Q4_1 / Q8_0 through our block layout,
  gguf's values bit for bit; other types with `gguf.quants.dequantize`), then cast to the
  run dtype by the model's loader;
- llama.cpp's converter permutes the rows of Q and K of llama-arch models (Llama,
  Mistral, SmolLM) from HF's rotate-half layout to GGML's interleaved one; we undo it
  exactly as transformers' GGUF loader does. qwen2 GGUFs are not permuted;
- the Q4_0 / Q4_1 / Q8_0 blocks of matmul weights are also handed out as stored
  (`iter_gguf_block_weights`), for the model to keep beside the dequantized weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.block_quant import (
    BLOCK,
    GGUF_BLOCK_FORMATS,
    BlockQuantWeight,
    from_gguf_blocks,
)

from .model_config import gguf_field

log = logging.getLogger(__name__)

# GGUF general.architecture values we load; "mistral" models are normally stored as llama
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")


# ---------------------------------------------------------------------------- weights

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def reverse_permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved -> HF rotate-half layout).

    weights: [n_head * head_dim, ...] (rows = output features; works for biases too).
    Per head, llama.cpp reordered rows (half, pair) -> (pair, half); we swap them back,
    as transformers' `_reverse_permute_weights` does.
    """
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _gguf_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for one the model does not know."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in _GGUF_LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"


def _permuted_heads(name: str, config: ModelConfig, permuted: bool) -> int:
    """Heads of a Q or K weight whose rows llama.cpp permuted (reverse_permute_qk), else 0."""
    if not permuted:
        return 0
    if ".attn_q." in name:
        return config.num_heads
    if ".attn_k." in name:
        return config.num_kv_heads
    return 0


def iter_gguf_weights(
    reader: Any, config: ModelConfig, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a file `open_gguf` opened, dequantized to float32, named and
    row-ordered as in Hugging Face checkpoints (Q/K rows unpermuted); ValueError for a
    tensor the model does not know. keep: only the tensors whose Hugging Face name it
    accepts are dequantized (a pipeline stage's)."""
    permuted = gguf_field(reader, "general.architecture") in _GGUF_PERMUTED_ARCHS
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        hf_name = _gguf_hf_name(t.name)
        if hf_name is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        if keep is not None and not keep(hf_name):
            continue
        weight = _dequantized(t)
        heads = _permuted_heads(t.name, config, permuted)
        if heads:
            weight = torch.from_numpy(reverse_permute_qk(weight.numpy(), heads))
        yield hf_name, weight


def _dequantized(tensor: Any) -> torch.Tensor:
    """A GGUF reader tensor as float32 [out, in] in memory of its own."""
    from gguf.quants import dequantize

    name = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    if name in GGUF_BLOCK_FORMATS and data.ndim == 2:
        # gguf's values bit for bit (tests/test_block_quant.py), in one vectorized pass
        # instead of gguf's groups of 16 rows: the default model loads seconds faster
        cols = data.shape[1] // GGUF_BLOCK_FORMATS[name][1] * BLOCK
        return from_gguf_blocks(data, name, (data.shape[0], cols)).dequantize()
    arr = dequantize(tensor.data, tensor.tensor_type)  # float32, numpy row-major
    # copy: memory-mapped (read-only) data must not back a torch tensor
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def iter_gguf_block_weights(
    reader: Any, config: ModelConfig
) -> Iterator[tuple[str, BlockQuantWeight]]:
    """The matmul and embedding tensors of a file `open_gguf` opened that are stored in a
    block format the decode kernels read (Q4_0, Q4_1, Q8_0), as stored, named and
    row-ordered as `iter_gguf_weights` names and orders their dequantized values; other
    tensors are skipped."""
    permuted = gguf_field(reader, "general.architecture") in _GGUF_PERMUTED_ARCHS
    for t in reader.tensors:
        hf_name = _gguf_hf_name(t.name)
        if t.tensor_type.name not in GGUF_BLOCK_FORMATS or hf_name is None:
            continue  # iter_gguf_weights reports unknown names
        data = np.asarray(t.data)
        nbytes = GGUF_BLOCK_FORMATS[t.tensor_type.name][1]
        shape = (data.shape[0], data.shape[1] // nbytes * BLOCK)
        weight = from_gguf_blocks(data, t.tensor_type.name, shape)
        heads = _permuted_heads(t.name, config, permuted)
        if heads:
            # the same row order as reverse_permute_qk gives the dequantized tensor
            order = reverse_permute_qk(np.arange(shape[0]), heads)
            weight = weight.rows(torch.from_numpy(order))
        yield hf_name, weight
