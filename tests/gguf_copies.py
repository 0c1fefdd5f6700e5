"""GGUF copies for test references: the same tensors, less metadata.

transformers reads a GGUF's metadata through gguf-py's `GGUFReader`, which builds numpy
views of every string of the tokenizer's vocabulary and merges (about 100,000 of them for
the default model) and does so twice for one `from_pretrained`: most of the 20 s its
float32 reference model takes to load on two cores. The model itself needs none of it.
"""

from __future__ import annotations

import struct
from pathlib import Path

from sarazmq.model.gguf_file import GGUFFile

#: the vocabulary's arrays; the tokenizer's scalars (special token ids, its model name,
#: the chat template) stay
VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


def gguf_without_vocabulary(src: Path, dst: Path) -> None:
    """Writes `src` to `dst` without its vocabulary (`VOCABULARY_KEYS`): every other
    metadata entry, the tensor descriptions and the tensor data copied byte for byte.
    ValueError for a file without `{arch}.vocab_size`, which transformers would then
    count from the vocabulary."""
    f = GGUFFile(str(src))
    vocab_key = f"{f.field('general.architecture')}.vocab_size"
    if vocab_key not in f.keys():
        raise ValueError(f"{src}: no {vocab_key} entry (transformers would count the vocabulary)")
    raw = src.read_bytes()
    entries = [raw[slice(*f.entry_span(k))] for k in f.keys() if k not in VOCABULARY_KEYS]
    head = b"GGUF" + struct.pack("<IQQ", f.version, len(f.tensors), len(entries))
    body = head + b"".join(entries) + raw[slice(*f.tensor_infos_span)]
    padding = -len(body) % f.alignment
    dst.write_bytes(body + b"\0" * padding + raw[f.data_start :])
