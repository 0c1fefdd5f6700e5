"""One matmul's weight and every form it is kept in (`LinearWeight`).

A matmul weight [out_features, in_features] of the model can be held four ways:

- plain: the tensor itself (a parameter: loaders fill it, state dicts carry it); what
  `F.linear`, the C matrix-vector kernel (`NativeCpuOps.linear`, 1-3 rows) and the fused
  decode step read where nothing else stands in for it;
- packed: oneDNN's blocked copy (`prepack`, CPU bf16 / float32), which matmuls of more
  rows read instead of the plain one (`sarazmq.kernels.ops.can_prepack_linear`);
- tiles: the AMX tile kernel's layout of it (`prepack(tiles=True)`, bf16 on CPUs with
  AMX, `sarazmq.kernels.linear_amx`), held instead of oneDNN's packed copy by ops that
  read it (`NativeCpuOps`): it streams the weights where oneDNN stalls on them;
- blocks: the GGUF checkpoint's own Q4_0 / Q4_1 / Q8_0 blocks of the same values
  (`attach_blocks`, `sarazmq.kernels.block_quant`), which decode rows read: bitwise the
  plain kernel's result from a fraction of the bytes; with `int8_blocks` set, every row
  reads them by int8 dot products instead (`sarazmq.kernels.int8_dot`, llama.cpp's
  precision);
- int8_panels: with `int8_blocks` set, the same weights repacked in panels of 16
  interleaved columns (`sarazmq.kernels.int8_dot.Int8Panels`, one byte a weight; Q4
  blocks, and Q8 ones on VPDPBUSD builds), which the per-op rows read, and the fused
  decode step for Q4 ones.

The owner keeps them together with the weight's optional bias, reports the bytes
each holds (`variant_bytes`), and can free the plain copy (`drop_plain`) once every path
that would read it reads another variant (which paths read what is the ops' call,
`HotOps.needs_plain`), or every float copy (`release_float_copies`) while int8 dot
products read the blocks for every row; turning int8 off rebuilds the plain weight from
the blocks. Its shape, dtype and device stay known after the plain copy is gone.
"""

from __future__ import annotations

import torch
from torch import nn

from .block_quant import BlockQuantWeight
from .int8_dot import Int8Panels, int8_dot_available, int8_panels_take, pack_int8_panels
from .linear_amx import pack_tiles, tiles_cover
from .ops import can_prepack_linear, prepack_linear

VARIANTS = ("plain", "packed", "tiles", "blocks", "int8_panels")


class LinearWeight(nn.Module):
    """A matmul weight [out_features, in_features] (+ bias [out_features]) and its variants.

    weight: the plain weight (kept as the `weight` parameter, not copied); bias: optional.
    keep_plain: the plain tensor is needed by something other than matmuls (a tied LM
    head's weight is the embedding table), so `drop_plain` refuses. The dtype and device
    are the plain weight's and fixed: convert the tensor before building the owner, never
    the owner (`.to()`) after.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        keep_plain: bool = False,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} for a weight of {weight.shape[0]} rows"
            )
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.dtype: torch.dtype = weight.dtype
        self.device: torch.device = weight.device
        self.keep_plain = keep_plain
        self.weight = _as_parameter(weight)
        self.bias = None if bias is None else _as_parameter(bias)
        # plain attributes, not parameters or buffers: state dicts and loaders ignore them
        self.packed: torch.Tensor | None = None  # opaque oneDNN tensor (`prepack`)
        self.tiles: torch.Tensor | None = None  # the AMX kernel's layout (`prepack`)
        self.blocks: BlockQuantWeight | None = None  # the checkpoint's blocks (`attach_blocks`)
        # True: every row reads the blocks by integer dot products (float32 only,
        # `sarazmq.kernels.int8_dot`: llama.cpp's precision, not the plain weight's result);
        # Q4 blocks then also in the panels that kernel reads fastest (`set_int8_blocks`)
        self.int8_blocks = False
        self.int8_panels: Int8Panels | None = None
        # True while `release_float_copies` left the int8 blocks as the only matmul weight
        self.float_released = False

    @classmethod
    def empty(
        cls,
        out_features: int,
        in_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LinearWeight:
        """An owner of an uninitialized [out_features, in_features] weight (and bias): a
        model's weights always come from a checkpoint, and random values for a large one
        would cost seconds for nothing."""
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        return cls(weight, b)

    def extra_repr(self) -> str:
        held = [v for v in VARIANTS if self.variant_bytes()[v]]
        return (
            f"out_features={self.out_features}, in_features={self.in_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, held={'+'.join(held) or '-'}"
        )

    # ------------------------------------------------------------------ the plain weight

    @property
    def has_plain(self) -> bool:
        """Whether the plain weight is still held (`drop_plain` frees it)."""
        return self.weight is not None

    @property
    def plain(self) -> nn.Parameter:
        """The plain weight [out_features, in_features]; ValueError once dropped."""
        if self.weight is None:
            raise ValueError(
                f"the plain [{self.out_features}, {self.in_features}] weight was dropped "
                "(drop_plain): it can no longer be loaded, packed or checked against blocks"
            )
        return self.weight

    def drop_plain(self) -> None:
        """Frees the plain weight, leaving the packed copy (and blocks, if any) to every
        matmul. Only for an owner whose plain weight no path of its ops reads any more
        (`HotOps.needs_plain`): this checks what the owner alone can tell, and raises
        ValueError where it is the embedding table too (keep_plain) or no packed copy
        could stand in for it."""
        if self.weight is None:
            return
        if self.keep_plain:
            raise ValueError("this weight's plain tensor is needed elsewhere (keep_plain)")
        if self.packed is None and self.tiles is None:
            raise ValueError("no packed copy: matmuls would have no weight to read")
        self.weight = None

    def variants_changed(self) -> None:
        """Drops the packed copy and the blocks, after the plain weight was rewritten (a
        load): they would hold the old values. ValueError once the plain weight was
        dropped (nothing would be left to read)."""
        if self.weight is None:
            raise ValueError("the plain weight was dropped: nothing would be left to read")
        self.packed = None
        self.tiles = None
        self.blocks = None
        self.int8_blocks = False
        self.int8_panels = None
        self.float_released = False

    # ------------------------------------------------------------------ other variants

    def prepack(self, tiles: bool = False) -> bool:
        """Adds a packed copy of the plain weight for matmuls of many rows: with tiles,
        the AMX kernel's layout where it covers this weight (bf16, no bias, sizes
        multiples of 32, see `sarazmq.kernels.linear_amx.tiles_cover`), else oneDNN's
        where that applies (CPU bf16 / float32, see `can_prepack_linear`); one or the
        other, never both. Returns whether it packed. A later load of the plain weight
        must call `variants_changed` (the pack would be stale). ValueError once the plain
        weight was dropped (the packed copy is then kept)."""
        plain = self.plain  # ValueError once dropped, before anything changes
        self.packed = None
        self.tiles = None
        with torch.no_grad():
            if (
                tiles
                and self.bias is None
                and tiles_cover(self.dtype, self.device, self.out_features, self.in_features)
            ):
                self.tiles = pack_tiles(plain)
                return True
            if not can_prepack_linear(self.dtype, self.device):
                return False
            self.packed = prepack_linear(plain)
        return True

    def attach_blocks(self, blocks: BlockQuantWeight, name: str) -> None:
        """Keeps the checkpoint's quantized blocks of this weight beside it.

        Raises ValueError (naming `name`) unless they dequantize to exactly the plain
        weight (in its dtype): blocks that did not would change results.
        """
        plain = self.plain
        if tuple(blocks.shape) != (self.out_features, self.in_features) or not torch.equal(
            blocks.dequantize().to(self.dtype), plain
        ):
            raise ValueError(
                f"{name}: the checkpoint's quantized blocks do not hold the loaded weight "
                f"(blocks {blocks.shape}, weight {tuple(plain.shape)})"
            )
        self.blocks = blocks
        if self.int8_blocks:  # the panels held the old blocks
            self.int8_panels = None
            self.set_int8_blocks(True)

    def detach_blocks(self) -> None:
        """Forgets the blocks (decode rows then read the plain weight). ValueError once the
        plain weight was dropped: the blocks are what those rows read instead of it."""
        if self.blocks is not None and self.weight is None:
            raise ValueError("the plain weight was dropped: decode rows read the blocks")
        self.blocks = None
        self.int8_blocks = False
        self.int8_panels = None
        self.float_released = False

    def set_int8_blocks(self, on: bool) -> bool:
        """Whether rows read the blocks by int8 dot products (`int8_blocks`); the blocks are
        repacked into `int8_panels` for it where the panel kernel takes their kind
        (`int8_panels_take`: Q4 on AVX2, Q8 too with VPDPBUSD; dropped again when off).
        Only float32 weights with blocks take it: returns whether it is on."""
        on = on and self.blocks is not None and self.dtype == torch.float32
        self.int8_blocks = on
        if not on:
            self.int8_panels = None
            if self.float_released and self.weight is None and self.blocks is not None:
                # the blocks hold the plain weight exactly (`attach_blocks`); repacking
                # it is the caller's (`prepack`)
                self.weight = _as_parameter(self.blocks.dequantize().to(self.dtype))
            self.float_released = False
        elif (
            self.int8_panels is None
            and self.blocks is not None
            and int8_panels_take(self.blocks.kind)
        ):
            self.int8_panels = pack_int8_panels(self.blocks)
        return on

    def release_float_copies(self) -> bool:
        """Frees the float copies (the packed one, AMX tiles, and the plain weight unless
        keep_plain) of a weight whose every row reads its blocks by int8 dot products
        (`int8_blocks` on, the int8 kernels built): no matmul reads them then, and for a
        large GGUF model they are most of the memory (float32: 4 bytes a weight, twice
        over with the packed copy, against the blocks' ~0.6). `set_int8_blocks(False)`
        rebuilds the plain weight from the blocks (exact); packing it again is the
        caller's. Returns whether it released them (False where int8 is off)."""
        if not (self.int8_blocks and self.blocks is not None and int8_dot_available()):
            return False
        self.packed = None
        self.tiles = None
        if not self.keep_plain:
            self.weight = None
        self.float_released = True
        return True

    # ------------------------------------------------------------------ accounting

    def variant_bytes(self) -> dict[str, int]:
        """Bytes held per variant (`VARIANTS`; 0 where not held).
        The packed copy is counted as its elements (oneDNN may pad it a little)."""
        return {
            "plain": 0 if self.weight is None else _tensor_bytes(self.weight),
            "packed": 0 if self.packed is None else _tensor_bytes(self.packed),
            "tiles": 0 if self.tiles is None else _tensor_bytes(self.tiles),
            "blocks": 0 if self.blocks is None else self.blocks.nbytes,
            "int8_panels": 0 if self.int8_panels is None else self.int8_panels.nbytes,
        }

    @property
    def nbytes(self) -> int:
        """Bytes held by all variants together (the bias not included)."""
        return sum(self.variant_bytes().values())


def _as_parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
