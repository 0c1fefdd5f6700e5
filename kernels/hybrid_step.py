"""A hybrid iteration in one C call (kernels/csrc/hybrid_step.c).

At a few hundred rows (a prefill chunk and the running decodes) the per-op path
(`LlamaForCausalLM.forward` with `NativeCpuOps` and `CpuPagedAttention`) spends a tenth of
an iteration in Python and torch around its ~300 kernel calls, while the other OpenMP
threads wait. Where that path's kernels are all native, `HybridStep` runs them in the same
order in one C function, so the output is bitwise the per-op path's (tested). Two models
are taken:

- bf16, every matmul on AMX tiles (`LinearWeight.tiles`, packed by `linear_amx_pack`) and
  prefill chunks through the AMX prefill kernel;
- float32 with `gguf_matmul="int8"`, every matmul Q4 int8 panels (`LinearWeight.
  int8_panels`: activations quantized, integer dot products) and prefill chunks through
  the float32 prefill kernel (AVX2 + FMA or AVX-512 builds): the default on CPUs without
  native bf16.

It is built by the model from its weights and KV caches when the backend offers it
(`CpuPagedAttention.hybrid_step`); `run` returns None wherever it does not apply (too few
rows for the tiles, a layout it does not take) and the model takes the per-op path. The
per-layer pointer table is the fused decode step's (kernels.h's
`DECODE_STEP_LAYER_SLOTS`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from .cpu_attention_kernels import prefill_int8_available, prefill_scratch_elems
from .cpu_ops import GEMV_MAX_ROWS_TILES
from .decode_step import (
    KV_SLOTS,
    MATMULS,
    DecodeLayerWeights,
    StepSizes,
    decode_step_layout,
    layer_slot_shapes,
    slot_pointers,
    step_inputs_fit,
)
from .int8_dot import Int8Panels
from .kv_int8 import INT8_SCALE_BYTES, is_int8_cache
from .metadata import AttentionMetadata
from .native import load_library

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_ARGTYPES = [
    _P,  # layer pointer table
    _I,  # num layers
    _P,  # final norm weight
    _P,  # x_in [T, hidden]
    _P,  # out [T, hidden]
    _P,  # work buffer
    _P,  # cos [T, D]
    _P,  # sin_signed [T, D]
    _P,  # slots [T] int64
    _P,  # block tables int32
    _L,  # block table row stride
    _P,  # q lens [num_seqs] int32
    _P,  # k lens [num_seqs] int32
    _I,  # num seqs
    _I,  # num decodes
    _I,  # T
    _I,  # hidden
    _I,  # H
    _I,  # Hkv
    _I,  # D
    _I,  # inter
    _I,  # block size
    _L,  # num blocks
    _F,  # eps
    _F,  # scale
    _P,  # prefill scratch
    _I,  # kv_int8
    _P,  # kv_dequant (int8 caches)
    _P,  # identity block ids (int8 caches)
]


def hybrid_step_kind(layers: Sequence[DecodeLayerWeights]) -> str | None:
    """Which hybrid step takes these matmuls: "tiles" (all flat bf16 tile layouts), "int8"
    (all Q4 int8 panels), None (a mix, or another form)."""
    matmuls = [getattr(w, name) for w in layers for name in MATMULS]
    if matmuls and all(isinstance(m, Int8Panels) and m.kind == "q4" for m in matmuls):
        return "int8"
    if matmuls and all(isinstance(m, torch.Tensor) and m.dim() == 1 for m in matmuls):
        return "tiles"
    return None


_KINDS = {"tiles": (torch.bfloat16, "hybrid_step_bf16"), "int8": (torch.float32, "hybrid_step_f32")}


class HybridStep:
    """A Llama model's hybrid iteration over fixed weights and KV caches, in one C call.

    layers: each layer's norms and its matmuls, all as their AMX tile layouts (flat bf16
    tensors of N * K elements, `LinearWeight.tiles`) or all as Q4 int8 panels of a float32
    model (`hybrid_step_kind`); kv_caches: per layer (k_cache, v_cache) of the model's
    dtype [num_blocks, block_size, Hkv, D] contiguous, or all int8 rows [num_blocks,
    block_size, Hkv, D + 4] (`kv_int8`: each chunk's context is dequantized to the model's
    dtype for the prefill kernel, as the per-op path does); final_norm: [hidden]; sizes:
    the model's `StepSizes`. Raises ValueError when the kernels are unavailable or a
    tensor does not fit.
    """

    def __init__(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> None:
        lib = load_library()
        if lib is None:
            raise ValueError("hybrid step unavailable: the native CPU kernels did not build")
        if not layers or len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} layers for {len(kv_caches)} KV caches")
        kind = hybrid_step_kind(layers)
        if kind is None:
            raise ValueError(
                "hybrid step: the matmuls must be all AMX tile layouts or all Q4 int8 panels"
            )
        self.kind = kind
        self.dtype, symbol = _KINDS[kind]
        tensors = [final_norm]  # the model's dtype: norms and tile layouts
        panel_tensors: list[torch.Tensor] = []  # int8 panels: uint8 values, float32 scales
        cache_tensors: list[torch.Tensor] = []
        for weights, caches in zip(layers, kv_caches, strict=True):
            for t in weights:
                if isinstance(t, Int8Panels):
                    panel_tensors.extend((t.qs, t.scales))
                else:
                    tensors.append(t)
            cache_tensors.extend(caches)
        self.kv_int8 = all(is_int8_cache(t) for t in cache_tensors)
        cache_dtype = torch.int8 if self.kv_int8 else self.dtype
        groups = ((tensors, self.dtype), (cache_tensors, cache_dtype), (panel_tensors, None))
        for group, want in groups:
            for t in group:
                if not (
                    isinstance(t, torch.Tensor)
                    and (want is None or t.dtype == want)
                    and t.device.type == "cpu"
                    and t.is_contiguous()
                ):
                    raise ValueError(
                        f"hybrid step ({kind}): every weight and cache must be a contiguous "
                        f"CPU tensor of {self.dtype} (caches: of {self.dtype} or all int8)"
                    )
        tensors.extend(panel_tensors)
        tensors.extend(cache_tensors)
        self.hidden = hidden = final_norm.shape[0]
        num_heads, num_kv_heads, head_dim = sizes.num_heads, sizes.num_kv_heads, sizes.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        down = layers[0].down
        self.inter = inter = (
            down.shape[1] if isinstance(down, Int8Panels) else down.numel() // hidden
        )
        self.eps, self.scale = sizes.eps, sizes.scale
        k0 = kv_caches[0][0]
        self.num_blocks, self.block_size = k0.shape[0], k0.shape[1]
        layout = decode_step_layout()
        shapes = layer_slot_shapes(
            lib,
            layout,
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            inter,
            self.num_blocks,
            self.block_size,
        )
        slot = {name: j for j, name in enumerate(layout.slots)}
        ptrs: list[int] = []
        for i, (weights, caches) in enumerate(zip(layers, kv_caches, strict=True)):
            row = [0] * len(layout.slots)
            named = [
                *zip(DecodeLayerWeights._fields, weights),
                *zip(KV_SLOTS, caches),
            ]
            for name, t in named:
                want = shapes[name]
                if name in KV_SLOTS and self.kv_int8:  # a row's D values and its scale
                    want = (*want[:3], want[3] + INT8_SCALE_BYTES)
                if isinstance(t, Int8Panels):  # the panels know their [N, K]
                    ok = t.shape == want
                elif name in MATMULS:  # a tile layout is flat: [N, K] in the kernel's order
                    ok = t.numel() == math.prod(want) and t.dim() == 1
                else:
                    ok = tuple(t.shape) == want
                if not ok:
                    got = t.shape if isinstance(t, Int8Panels) else tuple(t.shape)
                    raise ValueError(f"layer {i} {name}: shape {got}, expected {want}")
                for filled, address in slot_pointers(name, t).items():
                    row[slot[filled]] = address
            ptrs.extend(row)
        self._fn = getattr(lib, symbol)
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = _I
        self._work_elems = lib.decode_step_work_elems
        self._work_elems.argtypes = [_I] * 6
        self._work_elems.restype = _L
        self._table = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._num_layers = len(layers)
        self._keep = (tensors, layers)  # the table points into these
        self._final_norm = final_norm.data_ptr()
        # reused buffers ("work", "scratch"), grown to the largest iteration seen: fresh
        # pages every iteration would cost more than the Python this step saves
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, elems: int) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < elems:
            buf = self._buffers[name] = torch.empty(elems, dtype=self.dtype)
        return buf

    def _dequant_buffers(self, chunk_k: Sequence[int]) -> tuple[int, int]:
        """Int8 caches: pointers to the room (in the model's dtype) for the longest chunk's
        context blocks (K's, then V's) and to the block ids 0, 1, ... that the prefill
        kernel reads them by; (0, 0) for bf16 caches, no chunk, or the float32 step where
        the prefill kernel reads the int8 cache in place (`prefill_int8_available`)."""
        if not self.kv_int8 or not chunk_k or (self.kind == "int8" and prefill_int8_available()):
            return 0, 0
        longest = -(-max(chunk_k) // self.block_size)
        rows = longest * self.block_size * self.num_kv_heads * self.head_dim
        dequant = self._buffer("kv_dequant", 2 * rows)
        identity = self._buffers.get("identity")
        if identity is None or identity.numel() < longest:
            identity = self._buffers["identity"] = torch.arange(longest, dtype=torch.int32)
        return dequant.data_ptr(), identity.data_ptr()

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Runs every layer and the final norm for a hybrid batch.

        x: [T, hidden] embeddings (decodes first, then the chunks); cos, sin_signed:
        [T, 1, D] from `rope_cos_sin`; meta: the step's metadata. Writes this step's K/V
        into the caches and returns the final-normed hidden states [T, hidden], or None
        (nothing done) where the step does not apply.
        """
        t = x.shape[0]
        if (self.kind == "tiles" and t <= GEMV_MAX_ROWS_TILES) or not step_inputs_fit(
            x, cos, sin_signed, meta, self.dtype, self.hidden, self.head_dim
        ):
            # few rows: the per-op path's bf16 matmuls are not on the tiles there (its int8
            # panels take any number of rows)
            return None
        tables, lens, slots = meta.block_tables, meta.seq_lens_k, meta.slot_mapping
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        chunk_k = meta.k_lens[nd:]
        scratch_elems = (
            prefill_scratch_elems(max(chunk_k), self.num_kv_heads, self.head_dim) if chunk_k else 0
        )
        work_elems = self._work_elems(
            t, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.inter
        )
        work = self._buffer("work", work_elems)
        scratch = self._buffer("scratch", max(scratch_elems, 1))
        q_lens = (ctypes.c_int32 * num_seqs)(*meta.q_lens)
        dequant, identity = self._dequant_buffers(chunk_k)
        out = torch.empty((t, self.hidden), dtype=self.dtype)
        rc = self._fn(
            self._table,
            self._num_layers,
            self._final_norm,
            x.data_ptr(),
            out.data_ptr(),
            work.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            q_lens,
            lens.data_ptr(),
            num_seqs,
            nd,
            t,
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.inter,
            self.block_size,
            self.num_blocks,
            self.eps,
            self.scale,
            scratch.data_ptr(),
            int(self.kv_int8),
            dequant,
            identity,
        )
        if rc == -2:
            raise IndexError(
                f"hybrid step: a slot, sequence length or block id reaches outside the KV "
                f"cache ({self.num_blocks} blocks of {self.block_size} tokens)"
            )
        return out if rc == 0 else None
