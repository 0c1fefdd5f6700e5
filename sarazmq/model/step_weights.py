"""The model's one-call steps (`LlamaForCausalLM.fused_decode_step` and
`LlamaForCausalLM.hybrid_step`): what they read of its layers (per layer its norms and
each matmul in the form the step's kernels take) and `OneCallSteps`, which builds them
from the attention backend and keeps them while the weights and KV caches stay."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from sarazmq.kernels.decode_step import DecodeLayerWeights, FusedDecodeStep, Matmul, StepSizes
from sarazmq.kernels.hybrid_step import HybridStep
from sarazmq.kernels.linear_weight import LinearWeight

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM


def _layer_weights(
    layers: Iterable[Any], pick: Callable[[LinearWeight], Matmul | None]
) -> list[DecodeLayerWeights] | None:
    # None where a matmul has a bias (no step adds one) or `pick` finds no form it takes
    out = []
    for layer in layers:
        matmuls: dict[str, Matmul] = {}
        for name, w in layer.matmuls().items():
            m = None if w.bias is not None else pick(w)
            if m is None:
                return None
            matmuls[name] = m
        out.append(
            DecodeLayerWeights(
                input_norm=layer.input_layernorm,
                post_norm=layer.post_attention_layernorm,
                **matmuls,
            )
        )
    return out


def _decode_matmul(w: LinearWeight) -> Matmul | None:
    panels = w.int8_panels
    if panels is not None and panels.kind == "q4":  # gguf_matmul="int8": as per-op rows
        return panels
    if w.blocks is not None:
        return w.blocks
    return w.plain if w.has_plain else None


def decode_step_weights(layers: Iterable[Any]) -> list[DecodeLayerWeights] | None:
    """The fused decode step's view: a matmul as its Q4 int8 panels where the model computes
    them by int8 dot products (`LinearWeight.int8_panels`), else as its quantized blocks
    where it has them, else its plain weight; None where one is left with only a packed
    copy, or has a bias."""
    return _layer_weights(layers, _decode_matmul)


def _hybrid_matmul(w: LinearWeight) -> Matmul | None:
    if w.tiles is not None:
        return w.tiles
    panels = w.int8_panels
    return panels if panels is not None and panels.kind == "q4" else None


def hybrid_step_weights(layers: Iterable[Any]) -> list[DecodeLayerWeights] | None:
    """The hybrid step's view: each matmul's AMX tile layout, else its Q4 int8 panels (a
    float32 model computing them by int8 dot products); None where one has neither, or has
    a bias. (`HybridStep` takes all of one form.)"""
    return _layer_weights(layers, _hybrid_matmul)


class OneCallSteps:
    """A model's fused decode step and hybrid step, built on first use for its weights and
    the KV caches they are given, and kept while both stay the same (the caches' identity
    and storage, the final norm's storage); `forget` drops them when the weights change.
    `fused` / `hybrid` are None where the backend has no such step or the model does not
    fit it (a stage before the last, tensor parallel, a matmul bias, no AMX tile layout)."""

    def __init__(self) -> None:
        self.fused: FusedDecodeStep | None = None
        self.hybrid: HybridStep | None = None
        self._key: tuple[int, ...] | None = None

    def forget(self) -> None:
        """The weights changed: both steps are rebuilt on next use."""
        self._key = self.fused = self.hybrid = None

    def build(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Builds the steps of `model` for these caches, unless they were built for them
        already."""
        if model.norm is None or model.pp_size != 1:
            return  # a stage before the last: the steps end in the final norm
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), model.norm.data_ptr())
        if key == self._key:
            return
        self.forget()
        self._key = key
        if model.tp_size != 1:
            return  # the steps have no all-reduce
        cfg = model.config
        sizes = StepSizes(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale
        )
        layers = decode_step_weights(model.layers)
        if layers is not None:
            self.fused = model.attention.fused_decode_step(layers, model.norm, kv_caches, sizes)
        tiled = hybrid_step_weights(model.layers)
        if tiled is not None:
            self.hybrid = model.attention.hybrid_step(tiled, model.norm, kv_caches, sizes)
