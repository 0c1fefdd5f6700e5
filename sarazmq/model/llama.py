"""Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2) on our paged attention.

Written on our own attention interface (not transformers' modules): the whole batch is
one packed token axis T (decodes first, then prefill chunks), every layer writes its new
K/V into the paged cache and attends through `AttentionMetadata`.

Layout per layer (tensor parallel over `tp_size` ranks):
- qkv_proj: one column-parallel Linear [(Hl + 2*Hkvl) * D, hidden] (rank-local heads),
  with bias when config.qkv_bias (Qwen2);
- o_proj: row-parallel [hidden, Hl * D], all-reduced;
- gate_up_proj: column-parallel [2 * Il, hidden] (gate rows, then up rows), SwiGLU;
- down_proj: row-parallel [hidden, Il], all-reduced;
- embeddings and the lm head are replicated.
Parameters are allocated uninitialized; fill them with `sarazmq.model.loader.load_weights`
(or `random_init_` for tests).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sarazmq.config import ModelConfig
from sarazmq.kernels.block_quant import BlockQuantWeight, block_quant_kernels_available
from sarazmq.kernels.cpu_ops import TORCH_OPS, HotOps
from sarazmq.kernels.memory import zeros_huge_pages
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.kernels.ops import (
    build_rope_cache,
    can_prepack_linear,
    prepack_linear,
    rope_cos_sin,
)


class AttentionImpl(Protocol):
    """What the model needs from an attention backend (see sarazmq.kernels)."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def _check_tp(config: ModelConfig, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    for field, value in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp_size != 0:
            raise ValueError(f"{field}={value} is not divisible by tp={tp_size}")


def _param(
    *shape: int, dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Parameter:
    # uninitialized on purpose: weights always come from a checkpoint, and random init of a
    # large model would cost seconds for nothing
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder block (attention + SwiGLU MLP), rank-local shards."""

    def __init__(
        self,
        config: ModelConfig,
        tp_size: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        inter = config.intermediate_size // tp_size
        self.inter = inter
        h = config.hidden_size
        self.input_layernorm = _param(h, dtype=dtype, device=device)
        self.post_attention_layernorm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        self.qkv_bias = (
            _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
            if config.qkv_bias
            else None
        )
        self.o_proj = _param(h, self.q_size, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * inter, h, dtype=dtype, device=device)
        self.down_proj = _param(h, inter, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    attention: a backend from `sarazmq.kernels.select_attention_backend`.
    tp_rank / tp_size / tp_group: tensor parallel placement; tp_group is the
    torch.distributed process group used for the row-parallel all-reduces (None = default
    group), only used when tp_size > 1.
    dtype / device (keyword-only, optional): where the parameters are allocated.
    """

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionImpl,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_tp(config, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, {tp_size})")
        self.config = config
        self.attention = attention
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.scale = config.head_dim**-0.5
        h = config.hidden_size
        self.embed_tokens = _param(config.vocab_size, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_size, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = _param(h, dtype=dtype, device=device)
        # oneDNN-packed copies of the matmul weights (see prepack_linear_weights); plain
        # attributes, not parameters or buffers, so state dicts and loaders ignore them
        self._packed: list[dict[str, torch.Tensor | None]] = []
        self._packed_head: torch.Tensor | None = None
        # the checkpoint's quantized blocks of the same matmul weights, where the model was
        # loaded from a GGUF file (see load_block_quant_weights); per layer, by name
        self._blocks: list[dict[str, BlockQuantWeight | None]] = []
        self._blocks_head: BlockQuantWeight | None = None
        # decode steps of a few sequences through the backend's one-call step where it has
        # one (EngineConfig.enforce_eager turns it off); the step is built for these
        # weights and the KV caches it was given (see _fused_decode_step), under a key
        self.fused_decode = True
        self._fused_step: Any = None
        self._fused_key: tuple[int, ...] | None = None
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _param(config.vocab_size, h, dtype=dtype, device=device)
        )
        # float32 always: angles must not be rounded to the run dtype before cos/sin
        self.register_buffer(
            "cos_sin_cache",
            build_rope_cache(
                config.head_dim,
                config.max_position,
                config.rope_theta,
                config.rope_scaling,
                device=device,
            ),
            persistent=False,
        )

    # ------------------------------------------------------------------ forward

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Runs one hybrid batch.

        input_ids, positions: [T] (packed like the metadata: decodes first, then chunks);
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv_local, D].
        Returns the final-normed hidden states [T, hidden].
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        cfg = self.config
        t = input_ids.shape[0]
        d = cfg.head_dim
        eps = cfg.rms_norm_eps
        if positions.device != self.cos_sin_cache.device:
            positions = positions.to(self.cos_sin_cache.device)
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        # rotation tables once per pass, shared by every layer
        cos, sin = rope_cos_sin(positions, self.cos_sin_cache, x.dtype)  # [T, 1, D] each
        if self.fused_decode and 0 < t == meta.num_decodes == meta.num_seqs:
            # a few decodes: the whole step in one native call where the backend has one
            step = self._fused_decode_step(kv_caches)
            out = None if step is None else step.run(x, cos, sin, meta)
            if out is not None:
                return out
        residual: torch.Tensor | None = None
        packed = self._packed or [_NO_PACKED] * len(self.layers)
        blocks = self._blocks or [_NO_BLOCKS] * len(self.layers)
        # elementwise ops: the attention backend's fused kernels when it has them
        ops: HotOps = getattr(self.attention, "ops", TORCH_OPS)
        for layer, pk, bq, (k_cache, v_cache) in zip(
            self.layers, packed, blocks, kv_caches, strict=True
        ):
            h, residual = ops.rms_norm_(x, layer.input_layernorm, eps, residual)
            # [T, (Hl + 2 Hkvl) * D]
            qkv = ops.linear(h, layer.qkv_proj, layer.qkv_bias, pk["qkv"], bq["qkv"])
            qk_size = layer.q_size + layer.kv_size
            # q and k heads are adjacent in the fused output: rotate them together, in place
            qk = ops.apply_rope_(qkv[:, :qk_size].view(t, -1, d), cos, sin)  # [T, Hl + Hkvl, D]
            q = qk[:, : layer.num_heads]  # [T, Hl, D]
            k = qk[:, layer.num_heads :]  # [T, Hkvl, D]
            v = qkv[:, qk_size:].view(t, layer.num_kv_heads, d)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
            o = ops.linear(attn.reshape(t, layer.q_size), layer.o_proj, None, pk["o"], bq["o"])
            x = self._all_reduce(o)  # [T, hidden]
            h, residual = ops.rms_norm_(x, layer.post_attention_layernorm, eps, residual)
            # [T, 2 Il]
            gate_up = ops.linear(h, layer.gate_up_proj, None, pk["gate_up"], bq["gate_up"])
            act = ops.silu_mul(gate_up, layer.inter)  # [T, Il]
            down = ops.linear(act, layer.down_proj, None, pk["down"], bq["down"])  # [T, hidden]
            x = self._all_reduce(down)
        out, _ = ops.rms_norm_(x, self.norm, eps, residual)
        return out

    def _fused_decode_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The attention backend's fused decode step (`fused_decode_step`, e.g.
        `sarazmq.kernels.decode_step.FusedDecodeStep`) for these weights and caches, built
        once and kept while the caches and weights stay the same; None where the backend
        has none or the model does not fit it (tensor parallel, qkv bias)."""
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), self.norm.data_ptr())
        if key != self._fused_key:
            self._fused_key, self._fused_step = key, None
            make = getattr(self.attention, "fused_decode_step", None)
            if make is not None and self.tp_size == 1 and self.layers[0].qkv_bias is None:
                cfg = self.config
                blocks = self._blocks or [_NO_BLOCKS] * len(self.layers)
                self._fused_step = make(
                    [
                        (
                            layer.input_layernorm,
                            bq["qkv"] or layer.qkv_proj,
                            bq["o"] or layer.o_proj,
                            layer.post_attention_layernorm,
                            bq["gate_up"] or layer.gate_up_proj,
                            bq["down"] or layer.down_proj,
                        )
                        for layer, bq in zip(self.layers, blocks, strict=True)
                    ],
                    self.norm,
                    kv_caches,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    eps=cfg.rms_norm_eps,
                    scale=self.scale,
                )
        return self._fused_step

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab] (lm head replicated on every rank).

        out: optional float32 [N, vocab] destination. For a non-float32 model, passing a
        buffer the caller reuses saves a fresh many-MB tensor per step, whose new pages
        cost more than the copy (measured: 5.9 ms for 64 rows against 0.4 ms).
        """
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        ops: HotOps = getattr(self.attention, "ops", TORCH_OPS)
        logits = ops.linear(hidden, weight, None, self._packed_head, self._blocks_head)  # [N, V]
        if out is None:
            return logits.float()
        return out.copy_(logits)

    def prepack_linear_weights(self) -> bool:
        """Prepacks every matmul weight for oneDNN when that pays (bf16 and float32 on
        CPU, see `sarazmq.kernels.ops.can_prepack_linear`); faster matmuls, bit-identical
        in bf16, float32 sums in another order.

        Call after loading the weights (a later load would leave stale packs: loading
        drops them). Returns whether weights were packed.
        """
        self._packed = []
        self._packed_head = None
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        if not can_prepack_linear(weight.dtype, weight.device):
            return False
        with torch.no_grad():
            for layer in self.layers:
                self._packed.append(
                    {
                        "qkv": prepack_linear(layer.qkv_proj),
                        "o": prepack_linear(layer.o_proj),
                        "gate_up": prepack_linear(layer.gate_up_proj),
                        "down": prepack_linear(layer.down_proj),
                    }
                )
            self._packed_head = prepack_linear(weight)
        return True

    # ------------------------------------------------------------------ weights

    def random_init_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fills parameters with N(0, std) and norm weights with 1, for tests that need a
        model but no checkpoint. Draws rank-local shards, so TP ranks are not consistent
        with one unsharded model; use `load_hf_weights` for that."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self._packed, self._packed_head = [], None  # packs of the old weights are stale
        self._blocks, self._blocks_head = [], None
        self._fused_key = self._fused_step = None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "layernorm" in name or name == "norm":
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads full (unsharded) tensors named as in Hugging Face checkpoints.

        Accepts model.embed_tokens.weight, model.norm.weight, lm_head.weight and
        model.layers.N.{input_layernorm, post_attention_layernorm}.weight,
        model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}, ...o_proj.weight,
        model.layers.N.mlp.{gate,up,down}_proj.weight; fuses q/k/v and gate/up and keeps
        this rank's shard. Raises ValueError on unknown names, wrong shapes, or when a
        parameter is left unloaded.
        """
        cfg = self.config
        loaded: set[str] = set()
        self._packed, self._packed_head = [], None  # packs of the old weights are stale
        self._blocks, self._blocks_head = [], None
        self._fused_key = self._fused_step = None
        with torch.no_grad():
            for name, tensor in weights:
                self._load_one(name, tensor, loaded)
        expected = {"embed_tokens", "norm"} | ({"lm_head"} if self.lm_head is not None else set())
        for i in range(cfg.num_layers):
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
                expected.add(f"{i}.{part}")
            if cfg.qkv_bias:
                expected |= {f"{i}.q_bias", f"{i}.k_bias", f"{i}.v_bias"}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:12])}")

    def wants_block_quant_weights(self) -> bool:
        """Whether `load_block_quant_weights` would use a checkpoint's quantized blocks: a
        float32 or bf16 model on CPU, one rank, with the block kernels for its dtype built
        for this CPU."""
        return (
            self.embed_tokens.device.type == "cpu"
            and self.tp_size == 1
            and block_quant_kernels_available(self.embed_tokens.dtype)
        )

    def load_block_quant_weights(self, weights: Iterable[tuple[str, BlockQuantWeight]]) -> int:
        """Keeps a GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 blocks of weights already loaded
        (`load_hf_weights`, dequantized) beside them, named as there, for the
        matrix-vector kernels of decode steps (sarazmq.kernels.block_quant): the same
        results, a fraction of the bytes streamed. A fused weight (qkv, gate_up) gets blocks
        only when all its parts come in one format; others keep the float32 path.

        Raises ValueError when blocks do not dequantize to exactly the loaded weight (they
        would change results). Returns how many matmul weights got blocks (the LM head
        included).
        """
        if not self.wants_block_quant_weights():
            raise ValueError(
                "block-quantized weights need a float32 or bf16 CPU model on one rank, with "
                f"the block kernels for {self.embed_tokens.dtype} built for this CPU"
            )
        parts = dict(weights)
        fused = {
            "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv_proj"),
            "o": (("self_attn.o_proj",), "o_proj"),
            "gate_up": (("mlp.gate_proj", "mlp.up_proj"), "gate_up_proj"),
            "down": (("mlp.down_proj",), "down_proj"),
        }
        blocks: list[dict[str, BlockQuantWeight | None]] = []
        count = 0
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                entry: dict[str, BlockQuantWeight | None] = {}
                for key, (names, attr) in fused.items():
                    found = [parts.get(f"model.layers.{i}.{n}.weight") for n in names]
                    w = None
                    if all(f is not None for f in found) and len({f.kind for f in found}) == 1:
                        w = BlockQuantWeight.cat_rows(found)  # type: ignore[arg-type]
                        _check_blocks(w, getattr(layer, attr), f"layer {i} {attr}")
                        count += 1
                    entry[key] = w
                blocks.append(entry)
            head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
            head = parts.get(head_name)
            if head is not None:
                _check_blocks(head, self.embed_tokens if self.lm_head is None else self.lm_head,
                              head_name)  # fmt: skip
                count += 1
        self._blocks, self._blocks_head = blocks, head
        self._fused_key = self._fused_step = None  # rebuilt with the blocks
        return count

    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def _load_one(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        cfg = self.config
        r, n = self.tp_rank, self.tp_size
        d = cfg.head_dim
        if name == "model.embed_tokens.weight":
            _copy(self.embed_tokens, tensor, name)
            loaded.add("embed_tokens")
            return
        if name == "model.norm.weight":
            _copy(self.norm, tensor, name)
            loaded.add("norm")
            return
        if name == "lm_head.weight":
            if self.lm_head is not None:
                _copy(self.lm_head, tensor, name)
                loaded.add("lm_head")
            # tied models may still ship a copy of the embedding: nothing to do
            return
        if name.endswith("rotary_emb.inv_freq"):
            return  # computed from the config
        m = self._LAYER_RE.match(name)
        if m is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        i = int(m.group(1))
        if i >= cfg.num_layers:
            raise ValueError(f"weight {name!r} for layer {i} but model has {cfg.num_layers}")
        layer: LlamaDecoderLayer = self.layers[i]  # type: ignore[assignment]
        rest = m.group(2)
        hl, hkvl, il = layer.q_size, layer.kv_size, layer.inter
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            part = rest.split(".")[0]
            _copy(getattr(layer, part), tensor, name)
            loaded.add(f"{i}.{part}")
            return
        # per projection: (row offset in the fused qkv, local rows, rows of the full tensor)
        qkv = {
            "q": (0, hl, cfg.num_heads * d),
            "k": (hl, hkvl, cfg.num_kv_heads * d),
            "v": (hl + hkvl, hkvl, cfg.num_kv_heads * d),
        }
        m2 = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
        if m2 is not None:
            which, kind = m2.group(1), m2.group(2)
            offset, rows, full_rows = qkv[which]
            if tensor.shape[0] != full_rows:
                raise ValueError(f"{name}: expected {full_rows} rows, got {tuple(tensor.shape)}")
            shard = tensor[r * rows : (r + 1) * rows]  # heads are contiguous row groups
            if kind == "weight":
                _copy(layer.qkv_proj[offset : offset + rows], shard, name)
                loaded.add(f"{i}.{which}")
            else:
                if layer.qkv_bias is None:
                    raise ValueError(f"{name}: checkpoint has qkv bias but config.qkv_bias=False")
                _copy(layer.qkv_bias[offset : offset + rows], shard, name)
                loaded.add(f"{i}.{which}_bias")
            return
        if rest == "self_attn.o_proj.weight":
            _copy(layer.o_proj, _cols(tensor, r, n, name), name)
            loaded.add(f"{i}.o_proj")
            return
        m3 = re.fullmatch(r"mlp\.(gate|up)_proj\.weight", rest)
        if m3 is not None:
            which = m3.group(1)
            if tensor.shape[0] != cfg.intermediate_size:
                raise ValueError(
                    f"{name}: expected {cfg.intermediate_size} rows, got {tuple(tensor.shape)}"
                )
            offset = 0 if which == "gate" else il
            _copy(layer.gate_up_proj[offset : offset + il], tensor[r * il : (r + 1) * il], name)
            loaded.add(f"{i}.{which}")
            return
        if rest == "mlp.down_proj.weight":
            _copy(layer.down_proj, _cols(tensor, r, n, name), name)
            loaded.add(f"{i}.down_proj")
            return
        raise ValueError(f"unexpected weight {name!r} in checkpoint")


_NO_PACKED: dict[str, torch.Tensor | None] = {"qkv": None, "o": None, "gate_up": None, "down": None}
_NO_BLOCKS: dict[str, BlockQuantWeight | None] = {
    "qkv": None,
    "o": None,
    "gate_up": None,
    "down": None,
}


def _check_blocks(blocks: BlockQuantWeight, weight: torch.Tensor, name: str) -> None:
    if tuple(blocks.shape) != tuple(weight.shape) or not torch.equal(
        blocks.dequantize().to(weight.dtype), weight
    ):
        raise ValueError(
            f"{name}: the checkpoint's quantized blocks do not hold the loaded weight "
            f"(blocks {blocks.shape}, weight {tuple(weight.shape)})"
        )


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


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes one KV block takes on one rank, over all layers (K and V)."""
    _check_tp(config, tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * (config.num_kv_heads // tp_size) * config.head_dim * elem
    return per_layer * config.num_layers


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv_local, D], zeroed.

    All of them are views of one buffer, which on CPU is backed by huge pages where the
    OS allows (see `sarazmq.kernels.memory`): decode touches the cache at scattered slots.
    """
    _check_tp(config, tp_size)
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    shape = (num_blocks, block_size, config.num_kv_heads // tp_size, config.head_dim)
    per_cache = num_blocks * block_size * shape[2] * shape[3]
    flat = zeros_huge_pages(2 * config.num_layers * per_cache, dtype, device)
    caches = flat.view(config.num_layers, 2, *shape)  # [L, 2, blocks, block_size, Hkv, D]
    return [(caches[i, 0], caches[i, 1]) for i in range(config.num_layers)]
