"""What the model's one-call steps read of its layers (`LlamaForCausalLM.fused_decode_step`
and `LlamaForCausalLM.hybrid_step`): per layer its norms and each matmul in the form the
step's kernels take."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sarazmq.kernels.decode_step import DecodeLayerWeights, Matmul
from sarazmq.kernels.linear_weight import LinearWeight


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


def decode_step_weights(layers: Iterable[Any]) -> list[DecodeLayerWeights] | None:
    """The fused decode step's view: a matmul as its quantized blocks where it has them,
    else its plain weight; None where one is left with only a packed copy, or has a bias."""
    return _layer_weights(
        layers, lambda w: w.blocks if w.blocks is not None else (w.plain if w.has_plain else None)
    )


def hybrid_step_weights(layers: Iterable[Any]) -> list[DecodeLayerWeights] | None:
    """The hybrid step's view: each matmul's AMX tile layout; None where one has none, or
    has a bias."""
    return _layer_weights(layers, lambda w: w.tiles)
