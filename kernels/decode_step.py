"""A Llama decode step of a few sequences in one C call (kernels/csrc/decode_step.c).

With a handful of running sequences a decode step is bound by streaming the weights once,
and the Python around its ~300 kernel calls (argument checks, views, ctypes) adds a good
part again. `FusedDecodeStep` runs the kernels of the per-op path
(`LlamaForCausalLM.forward` with `NativeCpuOps` and `CpuPagedAttention`) in the same order
inside one C function; it is the CPU's counterpart of a captured CUDA graph, not a second
model. Up to `GEMV_MAX_ROWS` rows the per-op path runs these very kernels and the output
is bitwise the same; from 4 to 8 rows the per-op path's matmuls are oneDNN's and the fused
step keeps the matrix-vector kernel (float32 sums in another order), still faster with
the Python gone, up to `FUSED_MAX_ROWS` sequences.

A model loaded from a GGUF file passes its matmuls as the file's quantized blocks
(`BlockQuantWeight`, kernels/csrc/block_quant.c): the kernel rebuilds the very weights the
model holds (float32, or those rounded to bf16) in registers and sums them in the
matrix-vector kernel's order, so the results stay bitwise while a step streams a fraction
of the bytes; where every matmul reads blocks the step takes up to
`FUSED_MAX_ROWS_BLOCKS` sequences. Measurements behind both limits: docs/KERNELS.md.
With `gguf_matmul="int8"` the model passes its Q4 matmuls as int8 panels (`Int8Panels`) and
the step computes them as the per-op int8 path does (the same quantizer and kernel, so the
same result; llama.cpp's precision, not the float path's).

The per-layer pointer table's layout is declared once, in kernels/csrc/kernels.h
(`DECODE_STEP_LAYER_SLOTS`): the step reads the slot names and each slot's shape from the
library, checks them against `DecodeLayerWeights` and every tensor against its slot's
shape, and fills the table by name.

Built by the model (`LlamaForCausalLM`) from its weights and KV caches when the attention
backend offers it (`AttentionBackend.fused_decode_step`); `run` returns None wherever it
does not apply (a prefill in the batch, more rows than the matrix-vector kernel takes,
another dtype), and the model then takes the per-op path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .block_quant import BlockQuantWeight
from .int8_dot import Int8Panels
from .kv_int8 import INT8_SCALE_BYTES, is_int8_cache
from .metadata import AttentionMetadata
from .native import cpu_has_flag, load_library

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_STEP_ARGTYPES = [
    _P,  # layer pointer table
    _P,  # matmul weight formats [num layers, 4] int32
    _I,  # num layers
    _P,  # final norm weight
    _P,  # x_in [M, hidden]
    _P,  # out [M, hidden]
    _P,  # work buffer
    _P,  # cos [M, D]
    _P,  # sin_signed [M, D]
    _P,  # slots [M] int64
    _P,  # block tables int32
    _L,  # block table row stride
    _P,  # seq lens [M] int32
    _I,  # M
    _I,  # hidden
    _I,  # H
    _I,  # Hkv
    _I,  # D
    _I,  # inter
    _I,  # block size
    _L,  # num blocks
    _F,  # eps
    _F,  # scale
    _I,  # the caches hold int8 rows (sarazmq.kernels.kv_int8)
]
_SYMBOLS = {torch.float32: "decode_step_f32", torch.bfloat16: "decode_step_bf16"}
# Sequences up to which the fused step beats the per-op path (whose matmuls go to oneDNN
# past GEMV_MAX_ROWS) on the default model: docs/KERNELS.md, "FUSED_MAX_ROWS". The C
# matrix-vector kernel takes at most 8 rows (GEMV_MAX_ROWS in kernels.h).
FUSED_MAX_ROWS = {torch.bfloat16: 8, torch.float32: 6}
# The same with every matmul as the GGUF's quantized blocks (past 8 rows the kernel takes
# them 8 at a time per weight tile): docs/KERNELS.md, "FUSED_MAX_ROWS_BLOCKS". On CPUs
# with AMX the per-op path's bf16 matmuls run on the AMX tiles and overtake the block
# kernel past 8 rows (docs/PERF_LOG.md, "Sixth round"; again with the tile kernel,
# docs/KERNELS.md, "Two output rows side by side"). On AVX2 CPUs (no AVX-512) the float32
# block kernel dequantizes a weight tile once for all rows and the fused step wins up to
# the kernel's 64 rows (docs/KERNELS.md, "FUSED_MAX_ROWS_BLOCKS").
FUSED_MAX_ROWS_BLOCKS = {
    torch.bfloat16: 8 if cpu_has_flag("amx_bf16") else 16,
    torch.float32: 32 if cpu_has_flag("avx512f") else 64,
}


Matmul = torch.Tensor | BlockQuantWeight | Int8Panels
KV_SLOTS = ("k_cache", "v_cache")  # a layer's KV caches, as kernels.h names their slots
_SCALES = "_scales"  # slot "<matmul>_scales": that matmul's block scales
_FORMAT = {"q4": 1, "q8": 2}  # kernels.h's DECODE_STEP_W_Q4, _Q8 (DECODE_STEP_W_PLAIN = 0)
_FORMAT_INT8_PANELS = 3  # DECODE_STEP_W_I8P


def slot_pointers(name: str, t: Matmul | torch.Tensor) -> dict[str, int]:
    """The table slots a layer's tensor `name` fills and their addresses: a matmul held as
    GGUF blocks or int8 panels fills its own slot with its values and "<name>_scales"
    with its scales; any other tensor its own slot."""
    if isinstance(t, (BlockQuantWeight, Int8Panels)):
        return {name: t.qs.data_ptr(), name + _SCALES: t.scales.data_ptr()}
    return {name: t.data_ptr()}


class DecodeLayerWeights(NamedTuple):
    """One decoder layer's tensors, as the fused step reads them (all contiguous), named
    as kernels.h's DECODE_STEP_LAYER_SLOTS names their slots. A step also takes a matmul
    as the checkpoint's blocks (`BlockQuantWeight`, read by kernels/csrc/block_quant.c:
    bitwise the same result, a fraction of the bytes)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Matmul  # [(H + 2 Hkv) D, hidden]
    o: Matmul  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Matmul  # [2 inter, hidden]
    down: Matmul  # [hidden, inter]


MATMULS = ("qkv", "o", "gate_up", "down")  # the DecodeLayerWeights fields that are matmuls


class StepSizes(NamedTuple):
    """A model's sizes and constants that its one-call steps (the fused decode step, the
    hybrid step) take besides its tensors."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # RMSNorm epsilon
    scale: float  # attention softmax scale


class DecodeStepLayout(NamedTuple):
    """decode_step.c's per-layer table: slot names in table order, and the matmuls in the
    order of a layer's row of the formats table."""

    slots: tuple[str, ...]
    matmuls: tuple[str, ...]


def decode_step_layout() -> DecodeStepLayout:
    """The table layout the kernel library was built with (kernels.h's
    DECODE_STEP_LAYER_SLOTS and DECODE_STEP_MATMULS), checked by name against
    `DecodeLayerWeights` and `MATMULS`: ValueError on any difference (the step would read
    the wrong tensors) or when the library did not build."""
    lib = load_library()
    if lib is None:
        raise ValueError("fused decode step unavailable: the native CPU kernels did not build")
    for fn in (lib.decode_step_layer_slots, lib.decode_step_matmuls):
        fn.argtypes = []
        fn.restype = ctypes.c_char_p
    layout = DecodeStepLayout(
        tuple(lib.decode_step_layer_slots().decode().split()),
        tuple(lib.decode_step_matmuls().decode().split()),
    )
    want = {*DecodeLayerWeights._fields, *KV_SLOTS, *(m + _SCALES for m in MATMULS)}
    if (
        len(set(layout.slots)) != len(layout.slots)
        or set(layout.slots) != want
        or sorted(layout.matmuls) != sorted(MATMULS)
    ):
        raise ValueError(
            f"decode_step.c's layer slots {layout.slots} and matmuls {layout.matmuls} are not "
            f"DecodeLayerWeights' ({sorted(want)}; matmuls {MATMULS})"
        )
    return layout


def layer_slot_shapes(
    lib: ctypes.CDLL,
    layout: DecodeStepLayout,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inter: int,
    num_blocks: int,
    block_size: int,
) -> dict[str, tuple[int, ...] | None]:
    """The shape the step reads each slot with (None: no shape of its own, block scales),
    as the library declares it (decode_step_slot_shape)."""
    fn = lib.decode_step_slot_shape
    fn.argtypes = [_I, _I, _I, _I, _I, _I, _L, _I, _P]
    fn.restype = _I
    dims = (ctypes.c_long * 4)()
    shapes: dict[str, tuple[int, ...] | None] = {}
    for i, name in enumerate(layout.slots):
        rank = fn(i, hidden, num_heads, num_kv_heads, head_dim, inter, num_blocks, block_size, dims)
        if not 0 <= rank <= 4:
            raise ValueError(f"decode_step.c declares no shape for slot {i} ({name})")
        shapes[name] = tuple(dims[:rank]) if rank else None
    return shapes


def step_inputs_fit(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    meta: AttentionMetadata,
    dtype: torch.dtype,
    hidden: int,
    head_dim: int,
) -> bool:
    """Whether a one-call step (this module's, `sarazmq.kernels.hybrid_step`'s) can read
    these inputs as its C function does: x [T, hidden] contiguous CPU rows of `dtype`, cos
    and sin_signed T * head_dim contiguous elements of it, the metadata's block tables
    int32 with unit column stride, its key lengths int32 and slots int64, contiguous."""
    t = x.shape[0]
    tables, lens, slots = meta.block_tables, meta.seq_lens_k, meta.slot_mapping
    return not (
        x.dtype != dtype
        or x.device.type != "cpu"
        or x.shape[1] != hidden
        or not x.is_contiguous()
        or cos.dtype != dtype
        or sin_signed.dtype != dtype
        or not (cos.is_contiguous() and sin_signed.is_contiguous())
        or cos.numel() != t * head_dim
        or sin_signed.numel() != t * head_dim
        or tables.dtype != torch.int32
        or tables.stride(1) != 1
        or lens.dtype != torch.int32
        or not lens.is_contiguous()
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
    )


class FusedDecodeStep:
    """A Llama model's decode step over fixed weights and KV caches, in one C call.

    layers: each layer's weights; kv_caches: per layer (k_cache, v_cache), each
    [num_blocks, block_size, Hkv, D] contiguous; final_norm: [hidden]; sizes: the model's
    `StepSizes`. Raises ValueError when the kernels are unavailable or a tensor does not
    fit (dtype, device, layout).
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
            raise ValueError("fused decode step unavailable: the native CPU kernels did not build")
        if not layers or len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} layers for {len(kv_caches)} KV caches")
        dtype = final_norm.dtype
        if dtype not in _SYMBOLS:
            raise ValueError(f"fused decode step: unsupported dtype {dtype}")
        tensors = [final_norm]
        blocks: list[BlockQuantWeight | Int8Panels] = []
        cache_tensors: list[torch.Tensor] = []
        for weights, caches in zip(layers, kv_caches, strict=True):
            for t in weights:
                (blocks if isinstance(t, (BlockQuantWeight, Int8Panels)) else tensors).append(t)
            cache_tensors.extend(caches)
        # int8 panels: llama.cpp-style integer dot products, float32 steps only
        self.int8 = any(isinstance(t, Int8Panels) for t in blocks)
        if self.int8 and dtype != torch.float32:
            raise ValueError("fused decode step: int8 panels need a float32 model")
        if any(isinstance(t, Int8Panels) and t.kind != "q4" for t in blocks):
            raise ValueError("fused decode step: it reads Q4 int8 panels only (Q8: blocks)")
        # int8 caches (rows of D int8 values and their scale)
        self.kv_int8 = all(is_int8_cache(t) for t in cache_tensors)
        cache_dtype = torch.int8 if self.kv_int8 else dtype
        for group, want in ((tensors, dtype), (cache_tensors, cache_dtype)):
            for t in group:
                if t.dtype != want or t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(
                        "fused decode step: every weight and cache must be a contiguous CPU "
                        f"tensor of {dtype} (caches: of {dtype} or all int8)"
                    )
        tensors.extend(cache_tensors)
        self.dtype = dtype
        self.hidden = hidden = final_norm.shape[0]
        num_heads, num_kv_heads, head_dim = sizes.num_heads, sizes.num_kv_heads, sizes.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.inter = inter = layers[0].down.shape[1]
        self.eps, self.scale = sizes.eps, sizes.scale
        k0 = kv_caches[0][0]
        self.num_blocks, self.block_size = k0.shape[0], k0.shape[1]
        # the C step reads every shape blindly: check each tensor against the shape the
        # library declares for its slot, once, here
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
        for i, (weights, caches) in enumerate(zip(layers, kv_caches, strict=True)):
            for name, t in zip(DecodeLayerWeights._fields, weights, strict=True):
                if tuple(t.shape) != shapes[name]:
                    raise ValueError(
                        f"layer {i} {name}: shape {tuple(t.shape)}, expected {shapes[name]}"
                    )
            for name, t in zip(KV_SLOTS, caches, strict=True):
                want = shapes[name]
                if self.kv_int8:  # a row's D values and its scale's bytes
                    want = (*want[:3], want[3] + INT8_SCALE_BYTES)
                if tuple(t.shape) != want:
                    raise ValueError(
                        f"layer {i} KV cache ({name}): shape {tuple(t.shape)}, expected {want}"
                    )
        self._fn = getattr(lib, _SYMBOLS[dtype])
        self._fn.argtypes = _STEP_ARGTYPES
        self._fn.restype = _I
        self._work_elems = lib.decode_step_work_elems
        self._work_elems.argtypes = [_I] * 6
        self._work_elems.restype = _L
        # the per-layer pointer table, filled by slot name in the library's order
        slot = {name: j for j, name in enumerate(layout.slots)}
        ptrs: list[int] = []
        formats: list[int] = []
        for weights, caches in zip(layers, kv_caches, strict=True):
            row = [0] * len(layout.slots)
            for name, t in zip(DecodeLayerWeights._fields, weights, strict=True):
                for filled, address in slot_pointers(name, t).items():
                    row[slot[filled]] = address
            for name, t in zip(KV_SLOTS, caches, strict=True):
                row[slot[name]] = t.data_ptr()
            ptrs.extend(row)
            for name in layout.matmuls:
                w = getattr(weights, name)
                if isinstance(w, Int8Panels):
                    formats.append(_FORMAT_INT8_PANELS)
                else:
                    formats.append(_FORMAT[w.kind] if isinstance(w, BlockQuantWeight) else 0)
        self._table = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._formats = (ctypes.c_int32 * len(formats))(*formats)
        self.block_quant = bool(blocks)  # some matmul reads blocks (or int8 panels)
        self._all_blocks = len(blocks) == len(MATMULS) * len(layers)
        self._num_layers = len(layers)
        self._keep = (tensors, blocks)  # the table points into these
        self._final_norm = final_norm.data_ptr()
        self._work: dict[int, torch.Tensor] = {}

    @property
    def max_rows(self) -> int:
        """The most sequences one step takes."""
        table = FUSED_MAX_ROWS_BLOCKS if self._all_blocks else FUSED_MAX_ROWS
        return table[self.dtype]

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Runs every layer and the final norm for a batch of decodes.

        x: [M, hidden] embeddings of the M decode tokens; cos, sin_signed: [M, 1, D] from
        `rope_cos_sin`; meta: the step's metadata (all M sequences decodes). Writes this
        step's K/V into the caches and returns the final-normed hidden states [M, hidden],
        or None (nothing done) where the fused step does not apply.
        """
        m = x.shape[0]
        tables, lens, slots = meta.block_tables, meta.seq_lens_k, meta.slot_mapping
        if (
            not 1 <= m <= self.max_rows
            or not (m == meta.num_decodes == meta.num_seqs)
            or not step_inputs_fit(x, cos, sin_signed, meta, self.dtype, self.hidden, self.head_dim)
        ):
            return None
        work = self._work.get(m)
        if work is None:
            elems = self._work_elems(
                m, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.inter
            )
            work = self._work[m] = torch.empty(elems, dtype=self.dtype)
        out = torch.empty((m, self.hidden), dtype=self.dtype)
        rc = self._fn(
            self._table,
            self._formats,
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
            lens.data_ptr(),
            m,
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.inter,
            self.block_size,
            self.num_blocks,
            self.eps,
            self.scale,
            int(self.kv_int8),
        )
        if rc == -2:
            raise IndexError(
                f"decode step: a slot, sequence length or block id reaches outside the KV "
                f"cache ({self.num_blocks} blocks of {self.block_size} tokens)"
            )
        return out if rc == 0 else None
