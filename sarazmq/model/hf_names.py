"""Checkpoint tensors named as in Hugging Face checkpoints, mapped onto `LlamaForCausalLM`.

The model fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, and each
tensor-parallel rank keeps its shard: column-parallel weights (qkv, gate_up) a contiguous
group of rows (whole heads), row-parallel ones (o, down) a contiguous group of columns.
`load_hf_tensor` puts one named checkpoint tensor where it belongs; `expected_parts` is
what a complete checkpoint fills; `block_quant_targets` names, per fused matmul, the
checkpoint tensors whose quantized blocks stack into its blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.linear_weight import LinearWeight

if TYPE_CHECKING:
    from .llama import LlamaDecoderLayer, LlamaForCausalLM

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV_RE = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)")
_GATE_UP_RE = re.compile(r"mlp\.(gate|up)_proj\.weight")
# per fused matmul: (the checkpoint's parts, stacked along rows, the model's attribute)
_FUSED = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv_proj"),
    (("self_attn.o_proj",), "o_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "gate_up_proj"),
    (("mlp.down_proj",), "down_proj"),
)


def expected_parts(
    config: ModelConfig,
    layers: range | None = None,
    *,
    embed: bool = True,
    head: bool = True,
) -> set[str]:
    """The parts (as `load_hf_tensor` records them in `loaded`) a complete checkpoint of
    this architecture fills: for the whole model, or for a pipeline stage holding
    `layers`, the embedding table when `embed` and the final norm and LM head when
    `head`."""
    parts = {"embed_tokens"} if embed else set()
    if head:
        parts |= {"norm"} | (set() if config.tie_word_embeddings else {"lm_head"})
    for i in range(config.num_layers) if layers is None else layers:
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "q",
            "k",
            "v",
            "o_proj",
            "gate",
            "up",
            "down_proj",
        ):
            parts.add(f"{i}.{part}")
        if config.qkv_bias:
            parts |= {f"{i}.q_bias", f"{i}.k_bias", f"{i}.v_bias"}
    return parts


def stage_holds(model: LlamaForCausalLM, name: str) -> bool:
    """Whether this model (one pipeline stage) holds a part of checkpoint tensor `name`;
    True for names it does not know (loading them reports the error)."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens is not None
    if name in ("model.norm.weight", "lm_head.weight"):
        return model.is_last_stage
    m = _LAYER_RE.match(name)
    return m is None or int(m.group(1)) in model.layer_range


def load_hf_tensor(
    model: LlamaForCausalLM, name: str, tensor: torch.Tensor, loaded: set[str]
) -> None:
    """Copies the full (unsharded) checkpoint tensor `name` into this rank's part of the
    model and records the part in `loaded` (see `expected_parts`). Raises ValueError on an
    unknown name or a wrong shape."""
    cfg = model.config
    # a pipeline stage holds some of the parts: it skips the others' tensors
    if name == "model.embed_tokens.weight":
        if model.embed_tokens is not None:
            _copy(model.embed_tokens, tensor, name)
            loaded.add("embed_tokens")
        return
    if name == "model.norm.weight":
        if model.norm is not None:
            _copy(model.norm, tensor, name)
            loaded.add("norm")
        return
    if name == "lm_head.weight":
        if not cfg.tie_word_embeddings and model.lm_head is not None:
            _copy(model.lm_head.plain, tensor, name)
            loaded.add("lm_head")
        # tied models may still ship a copy of the embedding: nothing to do
        return
    if name.endswith("rotary_emb.inv_freq"):
        return  # computed from the config
    m = _LAYER_RE.match(name)
    if m is None:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    i = int(m.group(1))
    if i >= cfg.num_layers:
        raise ValueError(f"weight {name!r} for layer {i} but model has {cfg.num_layers}")
    if i not in model.layer_range:
        return  # another pipeline stage's layer
    layer: LlamaDecoderLayer = model.layers[i - model.layer_range.start]  # type: ignore[assignment]
    _load_layer_tensor(model, layer, i, m.group(2), name, tensor, loaded)


def _load_layer_tensor(
    model: LlamaForCausalLM,
    layer: LlamaDecoderLayer,
    i: int,
    rest: str,
    name: str,
    tensor: torch.Tensor,
    loaded: set[str],
) -> None:
    cfg = model.config
    r, n = model.tp_rank, model.tp_size
    d = cfg.head_dim
    hl, hkvl, il = layer.q_size, layer.kv_size, layer.inter
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        part = rest.split(".")[0]
        _copy(getattr(layer, part), tensor, name)
        loaded.add(f"{i}.{part}")
        return
    m = _QKV_RE.fullmatch(rest)
    if m is not None:
        which, kind = m.group(1), m.group(2)
        # (row offset in the fused qkv, local rows, rows of the full tensor)
        offset, rows, full_rows = {
            "q": (0, hl, cfg.num_heads * d),
            "k": (hl, hkvl, cfg.num_kv_heads * d),
            "v": (hl + hkvl, hkvl, cfg.num_kv_heads * d),
        }[which]
        if tensor.shape[0] != full_rows:
            raise ValueError(f"{name}: expected {full_rows} rows, got {tuple(tensor.shape)}")
        shard = tensor[r * rows : (r + 1) * rows]  # heads are contiguous row groups
        if kind == "weight":
            _copy(layer.qkv_proj.plain[offset : offset + rows], shard, name)
            loaded.add(f"{i}.{which}")
        else:
            if layer.qkv_proj.bias is None:
                raise ValueError(f"{name}: checkpoint has qkv bias but config.qkv_bias=False")
            _copy(layer.qkv_proj.bias[offset : offset + rows], shard, name)
            loaded.add(f"{i}.{which}_bias")
        return
    if rest == "self_attn.o_proj.weight":
        _copy(layer.o_proj.plain, _cols(tensor, r, n, name), name)
        loaded.add(f"{i}.o_proj")
        return
    m = _GATE_UP_RE.fullmatch(rest)
    if m is not None:
        which = m.group(1)
        if tensor.shape[0] != cfg.intermediate_size:
            raise ValueError(
                f"{name}: expected {cfg.intermediate_size} rows, got {tuple(tensor.shape)}"
            )
        offset = 0 if which == "gate" else il
        shard = tensor[r * il : (r + 1) * il]
        _copy(layer.gate_up_proj.plain[offset : offset + il], shard, name)
        loaded.add(f"{i}.{which}")
        return
    if rest == "mlp.down_proj.weight":
        _copy(layer.down_proj.plain, _cols(tensor, r, n, name), name)
        loaded.add(f"{i}.down_proj")
        return
    raise ValueError(f"unexpected weight {name!r} in checkpoint")


def block_quant_targets(
    model: LlamaForCausalLM,
) -> Iterator[tuple[str, tuple[str, ...], LinearWeight]]:
    """Per matmul weight of the model (one rank, unsharded; a pipeline stage's layers):
    (a label for errors, the checkpoint names whose blocks stack along rows into its
    blocks, its owner); the LM head last where the stage has it (a tied head under the
    embedding's name)."""
    for i, layer in zip(model.layer_range, model.layers, strict=True):
        for parts, attr in _FUSED:
            names = tuple(f"model.layers.{i}.{p}.weight" for p in parts)
            yield f"layer {i} {attr}", names, getattr(layer, attr)
    if model.lm_head is not None:
        tied = model.config.tie_word_embeddings
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        yield head, (head,), model.lm_head


def _cols(tensor: torch.Tensor, rank: int, size: int, name: str) -> torch.Tensor:
    # row-parallel layers keep a contiguous slice of input columns
    if tensor.dim() != 2 or tensor.shape[1] % size != 0:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} cannot be split in {size} columns")
    c = tensor.shape[1] // size
    return tensor[:, rank * c : (rank + 1) * c]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}"
        )
    dst.copy_(src)
