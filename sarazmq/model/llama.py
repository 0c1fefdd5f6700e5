"""Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2) on our paged attention.

Written on our own attention interface (not transformers' modules): the whole batch is
one packed token axis T (decodes first, then prefill chunks), every layer writes its new
K/V into the paged cache and attends through `AttentionMetadata`.

Layout per layer (tensor parallel over `tp_size` ranks), each matmul weight a
`LinearWeight` (the one owner of its plain, packed and block-quantized forms):
- qkv_proj: one column-parallel [(Hl + 2*Hkvl) * D, hidden] (rank-local heads), with
  bias when config.qkv_bias (Qwen2);
- o_proj: row-parallel [hidden, Hl * D], all-reduced;
- gate_up_proj: column-parallel [2 * Il, hidden] (gate rows, then up rows), SwiGLU;
- down_proj: row-parallel [hidden, Il], all-reduced;
- embeddings and the lm head are replicated; a tied lm head's weight is the embedding.
Pipeline parallel over `pp_size` stages: stage `pp_rank` holds the contiguous layers
`stage_layers(num_layers, pp_size, pp_rank)` (their KV caches only), the first stage the
embedding, the last the final norm and LM head (and the embedding too when tied). A
stage's `forward` takes the previous stage's activations and returns its own (see
`forward`).
Parameters are allocated uninitialized; fill them with `sarazmq.model.loader.load_weights`
(or `random_init_` for tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sarazmq.config import ModelConfig
from sarazmq.kernels.backend import AttentionBackend
from sarazmq.kernels.block_quant import BlockQuantWeight, block_quant_kernels_available
from sarazmq.kernels.decode_step import FusedDecodeStep
from sarazmq.kernels.hybrid_step import HybridStep
from sarazmq.kernels.linear_weight import VARIANTS, LinearWeight
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.kernels.ops import build_rope_cache, rope_cos_sin

from .hf_names import block_quant_targets, expected_parts, load_hf_tensor
from .kv_cache import check_tensor_parallel, stage_layers
from .step_weights import OneCallSteps


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
        where: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(h, **where)
        self.post_attention_layernorm = _param(h, **where)
        self.qkv_proj = LinearWeight.empty(
            self.q_size + 2 * self.kv_size, h, bias=config.qkv_bias, **where
        )
        self.o_proj = LinearWeight.empty(h, self.q_size, **where)
        self.gate_up_proj = LinearWeight.empty(2 * inter, h, **where)
        self.down_proj = LinearWeight.empty(h, inter, **where)

    def matmuls(self) -> dict[str, LinearWeight]:
        """The layer's matmul weights, by their names in the fused decode step
        (`DecodeLayerWeights`: qkv, o, gate_up, down)."""
        return {
            "qkv": self.qkv_proj,
            "o": self.o_proj,
            "gate_up": self.gate_up_proj,
            "down": self.down_proj,
        }


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    attention: a backend from `sarazmq.kernels.select_attention_backend`.
    tp_rank / tp_size / tp_group: tensor parallel placement; tp_group is the
    torch.distributed process group used for the row-parallel all-reduces (None = default
    group), only used when tp_size > 1.
    pp_rank / pp_size (keyword-only): this model's pipeline stage (see the module doc);
    ValueError when pp_size exceeds the layers.
    dtype / device (keyword-only, optional): where the parameters are allocated.
    """

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_tensor_parallel(config, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, {tp_size})")
        self.layer_range = stage_layers(config.num_layers, pp_size, pp_rank)
        self.config = config
        self.attention = attention
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.scale = config.head_dim**-0.5
        h = config.hidden_size
        first, last = self.is_first_stage, self.is_last_stage
        # the last stage's tied head reads the embedding table: it keeps one too
        has_embed = first or (last and config.tie_word_embeddings)
        self.embed_tokens: nn.Parameter | None = (
            _param(config.vocab_size, h, dtype=dtype, device=device) if has_embed else None
        )
        self.norm: nn.Parameter | None = _param(h, dtype=dtype, device=device) if last else None
        # registered before the layers: parameters keep the order random_init_ draws in
        self.lm_head: LinearWeight | None = None
        if last:
            self.lm_head = (
                # tied: the head's weight is the embedding table, which lookups always read
                LinearWeight(self.embed_tokens, keep_plain=True)
                if self.embed_tokens is not None and config.tie_word_embeddings
                else LinearWeight.empty(config.vocab_size, h, dtype=dtype, device=device)
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_size, dtype, device) for _ in self.layer_range
        )
        # decode steps of a few sequences and hybrid iterations through the backend's
        # one-call steps where it has them (EngineConfig.enforce_eager turns them off)
        self.fused_decode = True
        self.one_call_steps = OneCallSteps()
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

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def activation_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """Shape of the activations one stage hands the next for `num_tokens` tokens:
        the hidden states and the residual stream, stacked ([2, T, hidden])."""
        return (2, num_tokens, self.config.hidden_size)

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
        inputs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs one hybrid batch (through this stage's layers).

        input_ids, positions: [T] (packed like the metadata: decodes first, then chunks);
        kv_caches: per layer of this stage (k_cache, v_cache), each
        [num_blocks, block_size, Hkv_local, D]; inputs: on a pipeline stage after the
        first, the previous stage's activations (`activation_shape`), else None.
        Returns the final-normed hidden states [T, hidden] on the last stage, the
        activations for the next stage ([2, T, hidden]: hidden states, residual) on the
        others.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        cfg = self.config
        t = input_ids.shape[0]
        d = cfg.head_dim
        eps = cfg.rms_norm_eps
        if positions.device != self.cos_sin_cache.device:
            positions = positions.to(self.cos_sin_cache.device)
        residual: torch.Tensor | None = None
        if self.is_first_stage and self.embed_tokens is not None:
            if inputs is not None:
                raise ValueError("the first pipeline stage takes token ids, not activations")
            x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        else:
            if inputs is None or tuple(inputs.shape) != self.activation_shape(t):
                got = None if inputs is None else tuple(inputs.shape)
                raise ValueError(
                    f"pipeline stage {self.pp_rank} needs the previous stage's activations "
                    f"of shape {self.activation_shape(t)}, got {got}"
                )
            x, residual = inputs[0], inputs[1]
        # rotation tables once per pass, shared by every layer
        cos, sin = rope_cos_sin(positions, self.cos_sin_cache, x.dtype)  # [T, 1, D] each
        if self.fused_decode and self.pp_size == 1 and 0 < t == meta.num_decodes == meta.num_seqs:
            # a few decodes: the whole step in one native call where the backend has one
            step = self.fused_decode_step(kv_caches)
            out = None if step is None else step.run(x, cos, sin, meta)
            if out is not None:
                return out
        if self.fused_decode and self.pp_size == 1 and t > 1:
            # a hybrid batch: every layer in one native call where the backend has one
            hybrid = self.hybrid_step(kv_caches)
            out = None if hybrid is None else hybrid.run(x, cos, sin, meta)
            if out is not None:
                return out
        ops = self.attention.ops  # elementwise ops and matmuls: the backend's kernels
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h, residual = ops.rms_norm_(x, layer.input_layernorm, eps, residual)
            qkv = ops.linear(h, layer.qkv_proj)  # [T, (Hl + 2 Hkvl) * D]
            qk_size = layer.q_size + layer.kv_size
            # q and k heads are adjacent in the fused output: rotate them together, in place
            qk = ops.apply_rope_(qkv[:, :qk_size].view(t, -1, d), cos, sin)  # [T, Hl + Hkvl, D]
            q = qk[:, : layer.num_heads]  # [T, Hl, D]
            k = qk[:, layer.num_heads :]  # [T, Hkvl, D]
            v = qkv[:, qk_size:].view(t, layer.num_kv_heads, d)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
            o = ops.linear(attn.reshape(t, layer.q_size), layer.o_proj)  # [T, hidden]
            x = self._all_reduce(o)
            h, residual = ops.rms_norm_(x, layer.post_attention_layernorm, eps, residual)
            act = ops.linear_silu_mul(h, layer.gate_up_proj, layer.inter)  # [T, Il]
            x = self._all_reduce(ops.linear(act, layer.down_proj))  # [T, hidden]
        if self.norm is None:
            if residual is None:  # every stage has a layer, and the first one sets it
                raise RuntimeError(f"pipeline stage {self.pp_rank} ran no layer")
            # the residual is handed on unsummed: the next stage adds it exactly as the
            # next layer would in one piece (the same results as without stages)
            return torch.stack((x, residual))
        out, _ = ops.rms_norm_(x, self.norm, eps, residual)
        return out

    def fused_decode_step(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> FusedDecodeStep | None:
        """The attention backend's fused decode step (`AttentionBackend.fused_decode_step`)
        for these weights and caches, built once and kept while the caches and weights
        stay the same; None where the backend has none or the model does not fit it
        (tensor parallel, qkv bias). `forward` runs it for decode-only batches (unless
        `fused_decode` is off) where it takes the batch."""
        self.one_call_steps.build(self, kv_caches)
        return self.one_call_steps.fused

    def hybrid_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> HybridStep | None:
        """The attention backend's one-call hybrid iteration (`AttentionBackend.hybrid_step`)
        for these weights and caches, kept as `fused_decode_step` is; None where the
        backend has none or a matmul has no AMX tile layout. `forward` runs it for batches
        of more than one row (unless `fused_decode` is off) where it takes the batch."""
        self.one_call_steps.build(self, kv_caches)
        return self.one_call_steps.hybrid

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab] (lm head replicated on every rank
        of the last pipeline stage; ValueError on another stage).

        out: optional float32 [N, vocab] destination. For a non-float32 model, passing a
        buffer the caller reuses saves a fresh many-MB tensor per step, whose new pages
        cost more than the copy (docs/KERNELS.md, "Reused logits buffer").
        """
        if self.lm_head is None:
            raise ValueError(f"pipeline stage {self.pp_rank} has no LM head (the last stage has)")
        ops = self.attention.ops
        if out is None:
            return ops.linear(hidden, self.lm_head).float()  # [N, V]
        return ops.linear_into_f32(hidden, self.lm_head, out)

    # ------------------------------------------------------------------ matmul weights

    def matmul_weights(self) -> Iterator[tuple[str, LinearWeight]]:
        """Every matmul weight with its module name ("layers.0.qkv_proj", ..., the model's
        layer numbers), the LM head ("lm_head", the embedding table when tied) last, where
        this pipeline stage has them."""
        for i, layer in zip(self.layer_range, self.layers, strict=True):
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                yield f"layers.{i}.{attr}", getattr(layer, attr)
        if self.lm_head is not None:
            yield "lm_head", self.lm_head

    def weight_bytes(self) -> dict[str, int]:
        """Bytes the matmul weights hold, per variant ("plain", "packed", "blocks"; see
        `LinearWeight.variant_bytes`); a tied LM head's plain weight is the embedding
        table, counted here once."""
        total = dict.fromkeys(VARIANTS, 0)
        for _, w in self.matmul_weights():
            for variant, n in w.variant_bytes().items():
                total[variant] += n
        return total

    def prepack_linear_weights(self, drop_unused_plain: bool = False) -> bool:
        """Prepacks every matmul weight when that pays: into the AMX tile kernel's layout
        where the backend's ops read it (`HotOps.reads_tiles`: bf16 on CPUs with AMX),
        else for oneDNN (bf16 and float32 on CPU, see
        `sarazmq.kernels.ops.can_prepack_linear`); faster matmuls, float32 sums per output
        in another order than the plain path's.

        Call after loading the weights (loading drops the packs, which would be stale).
        drop_unused_plain: free each weight's plain copy as soon as it is packed where no
        path reads it any more (as `drop_unused_plain_weights`), so that memory peaks at
        the model plus one packed weight, not two copies of the model (a 7B model in bf16
        on a 23 GB machine). Weights whose float copies int8 matmuls released
        (`set_gguf_matmul`) are left as they are. Returns whether weights were packed.
        """
        tiles = self.attention.ops.reads_tiles
        self.one_call_steps.forget()  # rebuilt for what the per-op path reads
        packed = []
        for _, w in self.matmul_weights():
            if w.float_released:
                continue  # int8 rows read its blocks: nothing would read a pack
            packed.append(w.prepack(tiles=tiles))
            if drop_unused_plain and self._plain_unused(w):
                w.drop_plain()
        return all(packed)

    def _plain_unused(self, w: LinearWeight) -> bool:
        """Whether no path of this model reads `w`'s plain copy any more."""
        return w.has_plain and not w.keep_plain and not self.attention.ops.needs_plain(w)

    def drop_unused_plain_weights(self) -> int:
        """Frees the plain copy of every matmul weight that no path of this model reads
        any more (`HotOps.needs_plain` of the backend's ops: a packed copy for matmuls of
        many rows, and on the native CPU ops quantized blocks for decode rows and the
        fused step). Results stay bitwise the same; the model can no longer be loaded,
        packed or given blocks. Returns how many were dropped."""
        dropped = 0
        for _, w in self.matmul_weights():
            if self._plain_unused(w):
                w.drop_plain()
                dropped += 1
        if dropped:
            self.one_call_steps.forget()  # rebuilt without them
        return dropped

    # ------------------------------------------------------------------ loading

    def _weights_rewritten(self) -> None:
        """Before new values go into the plain weights: every derived copy would be stale."""
        for name, w in self.matmul_weights():
            if not w.has_plain:
                raise ValueError(
                    f"{name}: its plain weight was dropped (drop_unused_plain_weights); "
                    "load into a new model"
                )
            w.variants_changed()
        self.one_call_steps.forget()

    def random_init_(self, seed: int = 0, std: float = 0.02) -> None:
        """Fills parameters with N(0, std) and norm weights with 1, for tests that need a
        model but no checkpoint. Draws rank-local shards, so TP ranks are not consistent
        with one unsharded model; use `load_hf_weights` for that."""
        self._weights_rewritten()
        device = next(self.parameters()).device
        # drawn where the weights live: a dummy 8B model's weights on a GPU in seconds, not
        # billions of host draws copied over (so the values depend on the device's RNG)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "layernorm" in name or name == "norm":
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads full (unsharded) tensors named as in Hugging Face checkpoints.

        Accepts model.embed_tokens.weight, model.norm.weight, lm_head.weight and
        model.layers.N.{input_layernorm, post_attention_layernorm}.weight,
        model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}, ...o_proj.weight,
        model.layers.N.mlp.{gate,up,down}_proj.weight (see `sarazmq.model.hf_names`);
        fuses q/k/v and gate/up and keeps this rank's shard. Raises ValueError on unknown
        names, wrong shapes, or when a parameter is left unloaded.
        """
        self._weights_rewritten()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                load_hf_tensor(self, name, tensor, loaded)
        expected = expected_parts(
            self.config,
            self.layer_range,
            embed=self.embed_tokens is not None,
            head=self.is_last_stage,
        )
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:12])}")

    def wants_block_quant_weights(self) -> bool:
        """Whether `load_block_quant_weights` would use a checkpoint's quantized blocks: a
        float32 or bf16 model on CPU, one rank, with the block kernels for its dtype built
        for this CPU."""
        weight = self.layers[0].input_layernorm  # every stage has a layer
        return (
            weight.device.type == "cpu"
            and self.tp_size == 1
            and block_quant_kernels_available(weight.dtype)
        )

    def load_block_quant_weights(self, weights: Iterable[tuple[str, BlockQuantWeight]]) -> int:
        """Keeps a GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 blocks of weights already loaded
        (`load_hf_weights`, dequantized) beside them (`LinearWeight.attach_blocks`), named
        as there, for the matrix-vector kernels of decode steps
        (sarazmq.kernels.block_quant): the same results, a fraction of the bytes streamed.
        A fused weight (qkv, gate_up) gets blocks only when all its parts come in one
        format; others keep the plain path.

        Raises ValueError (and keeps no blocks) when blocks do not dequantize to exactly
        the loaded weight (they would change results). Returns how many matmul weights got
        blocks (the LM head included).
        """
        if not self.wants_block_quant_weights():
            raise ValueError(
                "block-quantized weights need a float32 or bf16 CPU model on one rank, with "
                f"the block kernels for {self.layers[0].input_layernorm.dtype} built for this CPU"
            )
        parts = dict(weights)
        self.clear_block_quant_weights()
        count = 0
        try:
            with torch.no_grad():
                for label, names, owner in block_quant_targets(self):
                    found = [parts[n] for n in names if n in parts]
                    if len(found) != len(names) or len({f.kind for f in found}) != 1:
                        continue  # a part missing or in another format: the plain path
                    owner.attach_blocks(BlockQuantWeight.cat_rows(found), label)
                    count += 1
        except ValueError:
            self.clear_block_quant_weights()
            raise
        self.one_call_steps.forget()  # rebuilt with the blocks
        return count

    def set_gguf_matmul(self, mode: str, release_float_copies: bool = False) -> int:
        """How matmuls on the quantized blocks compute (`EngineConfig.gguf_matmul`):
        "float" (the float32 weights rebuilt: bitwise the plain model) or "int8" (every row
        of a float32 model by int8 dot products, sarazmq.kernels.int8_dot: llama.cpp's
        precision; on builds without VPDPBUSD, Q8 blocks within the float block kernel's
        rows take that kernel, `NativeCpuOps.linear`). Returns how many matmul weights now
        take int8. The fused decode step (decode-only steps, `fused_decode`) then reads
        the Q4 matmuls as int8 panels too (`LinearWeight.int8_panels`; Q8 ones keep its
        float block kernel). ValueError for another mode ("auto" is resolved before the
        model is built).

        release_float_copies (with "int8"): frees the float copies no matmul reads any more
        (`LinearWeight.release_float_copies`: the packed and plain weights of every int8
        matmul; the tied embedding stays); "float" later rebuilds them from the blocks
        (exactly) and packs them again, as `prepack_linear_weights(drop_unused_plain=True)`
        does."""
        if mode not in ("float", "int8"):
            raise ValueError(f"unknown gguf_matmul {mode!r}; choose 'float' or 'int8'")
        count = 0
        tiles = self.attention.ops.reads_tiles
        for _, w in self.matmul_weights():
            released = w.float_released
            count += w.set_int8_blocks(mode == "int8")
            if mode == "int8" and release_float_copies:
                w.release_float_copies()
            elif released and mode == "float":
                w.prepack(tiles=tiles)
                if self._plain_unused(w):
                    w.drop_plain()
        self.one_call_steps.forget()
        return count

    def clear_block_quant_weights(self) -> None:
        """Forgets every matmul's quantized blocks (decode rows read the plain weights
        again: the same results). ValueError where a plain weight was dropped."""
        for _, w in self.matmul_weights():
            w.detach_blocks()
        self.one_call_steps.forget()
