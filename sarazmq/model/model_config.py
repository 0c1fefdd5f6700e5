"""A model's architecture (`ModelConfig`) read from its files: GGUF metadata or a
transformers config.json (+ generation_config.json), or a named built-in architecture.

Torch-free: the launcher resolves a deployment's config with it before any process
imports torch (`sarazmq.resolve`). llama3 rope scaling, which a GGUF stores as a
`rope_freqs.weight` tensor of per-frequency divisors, is recovered as the equivalent
`RopeScaling("llama3", ...)` (checked to reproduce the tensor).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import numpy as np

from sarazmq.config import ModelConfig, RopeScaling

from .architectures import get_architecture
from .gguf_file import GGUFFile
from .source import ModelSource

log = logging.getLogger(__name__)

_GGUF_ARCHS = ("llama", "mistral", "qwen2")


def open_gguf(path: str) -> Any:
    """The file's metadata and tensors: `GGUFFile` (fast), or gguf-py's `GGUFReader` (slow
    for a large vocabulary) for files GGUFFile does not read. Read its fields with
    `gguf_field`; both list `.tensors` alike."""
    try:
        return GGUFFile(path)
    except ValueError as exc:
        import gguf

        log.info("reading %s with gguf.GGUFReader: %s", path, exc)
        return gguf.GGUFReader(path)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata field `key` of a file `open_gguf` opened, `default` where it is absent."""
    if isinstance(reader, GGUFFile):
        return reader.field(key, default)
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def llama3_scaling_from_rope_freqs(
    rope_freqs: np.ndarray, head_dim: int, theta: float
) -> RopeScaling | None:
    """Recovers llama3 RopeScaling parameters from llama.cpp's `rope_freqs` divisors.

    llama.cpp stores r_j with inv_freq_used = inv_freq_j / r_j, where r_j = 1 for short
    wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s) in between, with
    s = (L / wavelen - lo) / (hi - lo). That curve depends only on factor and the line
    s(1 / wavelen), so any (L, lo, hi) on that line reproduces it: we fix lo = 1 and solve
    L and hi, then check the result reproduces the tensor.
    """
    r = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if r.shape[0] != head_dim // 2:
        raise ValueError(
            f"rope_freqs has {r.shape[0]} entries, expected head_dim/2={head_dim // 2}"
        )
    factor = float(r.max())
    if np.allclose(r, 1.0, rtol=1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    tol = 1e-5
    medium = (r > 1 + tol) & (r < factor * (1 - tol))
    if medium.sum() >= 2:
        s = (1.0 / r[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(1.0 / wavelen[medium], s, 1)  # s = a / wavelen + b
        if a <= 0 or b >= 0:
            raise ValueError("rope_freqs does not follow the llama3 scaling curve")
        hi_minus_lo = -1.0 / b  # with lo = 1: b = -lo / (hi - lo)
        old_len = a * hi_minus_lo
        scaling = RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=1.0 + hi_minus_lo * round(old_len) / old_len,
            original_max_position=int(round(old_len)),
        )
    elif medium.sum() == 0:
        # a step: any boundaries between the last kept and the first divided wavelength
        kept = wavelen[r <= 1 + tol]
        divided = wavelen[r >= factor * (1 - tol)]
        if kept.size and divided.size and kept.max() >= divided.min():
            raise ValueError("rope_freqs does not follow the llama3 scaling curve")
        lo_wl = float(kept.max()) if kept.size else 0.0
        hi_wl = float(divided.min()) if divided.size else 2.0 * lo_wl + 1.0
        old_len = max(1, math.floor(hi_wl * (1 - 1e-9)))
        if old_len <= lo_wl:
            raise ValueError("cannot place llama3 rope scaling boundaries for rope_freqs")
        scaling = RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=old_len / ((lo_wl + old_len) / 2),
            original_max_position=old_len,
        )
    else:
        # one interpolated frequency: s = (L / w - 1) / (hi - 1) fixes hi once L is placed
        # between it and the first divided wavelength
        w = float(wavelen[medium][0])
        s = float((1.0 / r[medium][0] - 1.0 / factor) / (1.0 - 1.0 / factor))
        divided = wavelen[r >= factor * (1 - tol)]
        b = float(divided.min()) if divided.size else 2.0 * w + 2.0
        old_len = math.floor((w + b) / 2)
        if old_len <= w:
            raise ValueError("cannot place llama3 rope scaling boundaries for rope_freqs")
        scaling = RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=1.0 + (old_len / w - 1.0) / s,
            original_max_position=old_len,
        )
    from sarazmq.kernels.ops import rope_inv_freq

    base = rope_inv_freq(head_dim, theta, None).double().numpy()
    got = rope_inv_freq(head_dim, theta, scaling).double().numpy()
    if not np.allclose(got, base / r, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs could not be reproduced by llama3 rope scaling parameters")
    return scaling


def gguf_model_config(reader: Any) -> ModelConfig:
    """ModelConfig from the metadata (and rope_freqs tensor) of a file `open_gguf` opened."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {_GGUF_ARCHS}")

    def key(name: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head_dim {head_dim}) unsupported")
    theta = float(key("rope.freq_base", 10000.0))
    max_position = int(key("context_length", 2048))
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    scaling: RopeScaling | None = None
    scaling_type = key("rope.scaling.type")
    if scaling_type in (None, "none"):
        linear = key("rope.scale_linear")
        if linear is not None and float(linear) != 1.0:
            scaling = RopeScaling("linear", factor=float(linear))
    elif scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor", 1.0)))
    else:
        raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ValueError("GGUF has both rope_freqs and rope.scaling metadata")
        t = tensors["rope_freqs.weight"]
        from gguf.quants import dequantize

        freqs = dequantize(t.data, t.tensor_type)
        scaling = llama3_scaling_from_rope_freqs(freqs, head_dim, theta)
    name = str(gguf_field(reader, "general.name", "")).lower()
    if arch == "qwen2":
        architecture = "Qwen2ForCausalLM"
    elif arch == "mistral" or "mistral" in name:
        architecture = "MistralForCausalLM"
    else:
        architecture = "LlamaForCausalLM"
    eos: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = gguf_field(reader, f"tokenizer.ggml.{k}")
        if v is not None:
            eos.append(int(v))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position=max_position,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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
