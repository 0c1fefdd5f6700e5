"""A GGUF model cut to its first N transformer blocks, every tensor copied as stored.

The device check (scripts/gpu_check.sh) runs on a lent machine that reaches no network
and takes at most 64 MiB of files, while the default model's GGUF is 98 MB. Its first
blocks, with the real embedding, norms and tokenizer, fit: the GPU path's exactness
against the CPU float32 path is then checked on real weights (the same quantized bytes,
fewer layers), not on random ones, whose near-uniform logits tie too often to compare.

    python scripts/gguf_truncate.py IN.gguf OUT.gguf --blocks 8
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf

from sarazmq.model.gguf_file import GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncate_gguf(src: Path, dst: Path, blocks: int) -> int:
    """Writes `src` with only blocks 0..blocks-1 to `dst`; returns the block count of
    `src`. ValueError when `blocks` is not in 1..that count or `src` has no block count."""
    # checked with the loader's lazy reader first: GGUFReader takes seconds to parse a
    # large vocabulary, a refusal should not
    meta = GGUFFile(str(src))
    arch = meta.field(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"{src}: no {gguf.Keys.General.ARCHITECTURE} field")
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = meta.field(count_key)
    if total is None:
        raise ValueError(f"{src}: no {count_key} field")
    total = int(total)
    if not 1 <= blocks <= total:
        raise ValueError(f"--blocks {blocks}: the model has {total} blocks; choose 1..{total}")
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = blocks if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if (m := _BLOCK.match(t.name)) is None or int(m[1]) < blocks]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--blocks", type=int, required=True, help="transformer blocks to keep")
    args = ap.parse_args()
    try:
        total = truncate_gguf(args.src, args.dst, args.blocks)
    except (OSError, ValueError) as e:
        print(f"gguf_truncate: {e}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {args.blocks} of {total} blocks, {args.dst.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
