"""A GGUF file's metadata and tensors, read lazily (the loader's view of a GGUF).

gguf-py's `GGUFReader` builds a numpy view for every part of every metadata field up
front; for a large vocabulary that takes seconds each time a file is opened (the engine
config and every worker's weights open it; docs/KERNELS.md, "GGUF metadata"). `GGUFFile` parses the same header (GGUF
versions 2 and 3, little-endian) with `struct`, skips over array values, and decodes a
field only when asked; tensors are numpy views into one memory map, shaped as
`GGUFReader` shapes them, so `gguf.quants.dequantize` takes them as they are. Files it
does not read (another version or byte order) raise ValueError, and the loader falls
back to `GGUFReader`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is a read-only view of the file (float32 / float16 [.., ne0]
    for those types, else the raw blocks as uint8 [.., bytes per row]); `shape` is in
    GGUF order (ne0 first), as GGUFReader gives it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """The metadata (`field`) and tensors (`tensors`) of a GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mm)
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (byte order?) not read here")
        self.version = version
        pos = 24
        # key -> (value type, offset of the value)
        self._fields: dict[str, tuple[int, int]] = {}
        self._entry_spans: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            entry_start = pos
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", self._buf, pos)
            pos += 4
            self._fields[key] = (vtype, pos)
            pos = self._skip(vtype, pos)
            self._entry_spans[key] = (entry_start, pos)
        tensor_infos_start = pos
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", self._buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
        #: byte range of the tensor descriptions (name, dims, type, offset each)
        self.tensor_infos_span = (tensor_infos_start, pos)
        self.alignment = int(self.field("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-pos // self.alignment) * self.alignment
        #: where the tensor data begins (tensor offsets count from here)
        self.data_start = start
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ------------------------------------------------------------------ fields

    def field(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key (int, float, bool, str, or a list), else default."""
        entry = self._fields.get(key)
        if entry is None:
            return default
        return self._value(*entry)

    def keys(self) -> list[str]:
        return list(self._fields)

    def entry_span(self, key: str) -> tuple[int, int]:
        """The byte range of a metadata entry (key, value type and value) in the file, to
        copy it as stored; KeyError for a key the file lacks."""
        return self._entry_spans[key]

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + n
        return bytes(self._buf[pos + 8 : end]).decode("utf-8"), end

    def _skip(self, vtype: int, pos: int) -> int:
        if vtype in _SCALARS:
            return pos + struct.calcsize(_SCALARS[vtype])
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            return pos + 8 + n
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if etype in _SCALARS:
                return pos + count * struct.calcsize(_SCALARS[etype])
            for _ in range(count):
                pos = self._skip(etype, pos)
            return pos
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    def _value(self, vtype: int, pos: int) -> Any:
        if vtype in _SCALARS:
            return struct.unpack_from(_SCALARS[vtype], self._buf, pos)[0]
        if vtype == _STRING:
            return self._string(pos)[0]
        etype, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if etype in _NUMPY:
            return np.frombuffer(self._buf, _NUMPY[etype], count, pos).tolist()
        out = []
        for _ in range(count):
            out.append(self._value(etype, pos))
            pos = self._skip(etype, pos)
        return out

    # ------------------------------------------------------------------ tensors

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], ttype: int, offset: int
    ) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(ttype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = tuple(reversed(dims))  # row-major: ne0 last
        if qtype == GGMLQuantizationType.F32:
            dtype, shape = np.dtype("<f4"), rows
        elif qtype == GGMLQuantizationType.F16:
            dtype, shape = np.dtype("<f2"), rows
        else:
            if dims[0] % block != 0:
                raise ValueError(f"{self.path}: tensor {name} rows are not whole blocks")
            dtype, shape = np.dtype(np.uint8), (*rows[:-1], dims[0] // block * type_size)
        count = int(np.prod(shape, dtype=np.int64))
        begin = start + offset
        end = begin + count * dtype.itemsize
        if end > len(self._mm):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = self._mm[begin:end].view(dtype).reshape(shape)
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), data)
