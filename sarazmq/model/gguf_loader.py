"""Reading GGUF files into the model: the architecture from the metadata, the weights
dequantized and named as in Hugging Face checkpoints, and the blocks the decode kernels
read as stored.

- weights are dequantized to float32 (Q4_0 / Q4_1 / Q8_0 through our block layout,
  gguf's values bit for bit; other types with `gguf.quants.dequantize`), then cast to the
  run dtype by the model's loader;
- llama.cpp's converter permutes the rows of Q and K of llama-arch models (Llama,
  Mistral, SmolLM) from HF's rotate-half layout to GGML's interleaved one; we undo it
  exactly as transformers' GGUF loader does. qwen2 GGUFs are not permuted;
- llama3 rope scaling is stored as a `rope_freqs.weight` tensor of per-frequency divisors;
  we recover the equivalent `RopeScaling("llama3", ...)` from it (and check it reproduces
  the tensor);
- the Q4_0 / Q4_1 / Q8_0 blocks of matmul weights are also handed out as stored
  (`iter_gguf_block_weights`), for the model to keep beside the dequantized weights.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
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

log = logging.getLogger(__name__)

# GGUF general.architecture values we load; "mistral" models are normally stored as llama
_GGUF_ARCHS = ("llama", "mistral", "qwen2")
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")


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
