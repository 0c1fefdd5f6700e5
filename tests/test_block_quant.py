"""GGUF block-quantized weights for float32 decode (kernels/csrc/block_quant.c,
sarazmq.kernels.block_quant): the blocks must dequantize to exactly gguf's values, the
kernel must give bitwise the float32 matrix-vector kernel's result on those values, and a
model that keeps the blocks must give bitwise the results of one that does not, on every
path (fused step, per op, logits) and from a real GGUF file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from test_decode_step import PerOpCpuAttention, _model

from sarazmq.kernels import AttentionBackend, CpuPagedAttention, TorchPagedAttention
from sarazmq.kernels.block_quant import (
    BlockQuantWeight,
    block_quant_kernels_available,
    block_quant_linear,
    from_gguf_blocks,
)
from sarazmq.kernels.cpu_ops import GEMV_MAX_ROWS, GEMV_MAX_ROWS_BLOCKS, gemv
from sarazmq.kernels.decode_step import FUSED_MAX_ROWS, FUSED_MAX_ROWS_BLOCKS, FusedDecodeStep
from sarazmq.kernels.ops import can_prepack_linear
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.model.loader import load_model, load_model_config, resolve_model

pytestmark = pytest.mark.skipif(
    not block_quant_kernels_available(),
    reason="no float32 block kernels in this CPU's build (neither AVX-512 nor AVX2)",
)

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _blocks(w: np.ndarray, type_name: str) -> tuple[BlockQuantWeight, np.ndarray]:
    """(our weight, gguf's dequantized float32) for w [N, K] quantized to type_name."""
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    return from_gguf_blocks(raw, type_name, w.shape), dequantize(raw, qtype)


DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not block_quant_kernels_available(torch.bfloat16), reason="no AVX512-BF16"
        ),
    ),
]


def _gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The plain matrix-vector kernel (gemv_f32 / gemv_bf16) on x's rows (at most 8)."""
    y = gemv(x, w.to(x.dtype).contiguous())
    assert y is not None
    return y


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_dequantize_to_exactly_gguf_values(type_name: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 3, (40, 1))).astype(np.float32)
    blocks, ref = _blocks(w, type_name)
    assert blocks.kind == ("q8" if type_name == "Q8_0" else "q4")
    assert blocks.shape == (40, 96)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(ref))
    assert blocks.nbytes == (40 * 48 + 40 * 3 * 8 if blocks.kind == "q4" else 40 * 96 + 40 * 3 * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n_k", [(100, 64), (48, 96), (960, 576), (16, 1536)])
def test_kernel_is_the_plain_kernel_on_the_dequantized_weight(
    dtype: torch.dtype, type_name: str, n_k: tuple[int, int]
) -> None:
    # bf16: the weights a bf16 model holds are the dequantized ones rounded to bf16
    n, k = n_k
    rng = np.random.default_rng(n + k)
    blocks, ref = _blocks((rng.standard_normal((n, k)) * 0.1).astype(np.float32), type_name)
    w = torch.from_numpy(ref)
    tol = 1e-4 if dtype == torch.float32 else 0.02
    for m in range(1, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = block_quant_linear(x, blocks)
        assert out is not None and out.shape == (m, n) and out.dtype == dtype
        assert torch.equal(out, _gemv(x, w)), f"{type_name} rows={m}"
        ref_out = x.float() @ w.to(dtype).float().T
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    # past 8 rows, groups of 8 rows over the same weight tiles: each group bitwise the
    # plain kernel on its rows (a last group of one row too, which sums as one row does)
    for rows in (17, 19, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = block_quant_linear(x, blocks)
        assert out is not None
        for r0 in range(0, rows, 8):
            assert torch.equal(out[r0 : r0 + 8], _gemv(x[r0 : r0 + 8], w)), f"{rows} rows"
    # strided rows (a view into a wider buffer) read right
    wide = torch.randn(3, k + 32).to(dtype)
    assert torch.equal(block_quant_linear(wide[:, :k], blocks), _gemv(wide[:, :k], w))


def test_kernel_declines_what_it_does_not_cover() -> None:
    blocks, _ = _blocks(np.ones((16, 64), np.float32), "Q4_1")
    assert block_quant_linear(torch.randn(65, 64), blocks) is None  # more rows than it takes
    assert block_quant_linear(torch.randn(1, 64).half(), blocks) is None  # float32, bf16 only
    assert block_quant_linear(torch.randn(1, 32), blocks) is None  # another K
    assert block_quant_linear(torch.randn(64, 2).T, blocks) is None  # column stride 64


def test_bad_blocks_are_errors_that_name_the_problem() -> None:
    raw = quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="no block kernel for GGUF type Q5_0"):
        from_gguf_blocks(raw, "Q5_0", (4, 64))
    with pytest.raises(ValueError, match=r"not a \[4, 96\] matrix"):
        from_gguf_blocks(raw, "Q4_1", (4, 96))
    with pytest.raises(ValueError, match="kind must be"):
        BlockQuantWeight("q5", torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, 2))
    with pytest.raises(ValueError, match="do not describe"):
        BlockQuantWeight("q4", torch.zeros(4, 30, dtype=torch.uint8), torch.zeros(4, 2, 2))
    q4 = from_gguf_blocks(raw, "Q4_1", (4, 64))
    q8, _ = _blocks(np.ones((4, 64), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="cannot stack"):
        BlockQuantWeight.cat_rows([q4, q8])


def test_rows_and_stacking_follow_the_dequantized_rows() -> None:
    rng = np.random.default_rng(3)
    a, ref_a = _blocks(rng.standard_normal((8, 64)).astype(np.float32), "Q4_1")
    b, ref_b = _blocks(rng.standard_normal((4, 64)).astype(np.float32), "Q4_0")
    stacked = BlockQuantWeight.cat_rows([a, b])
    assert torch.equal(stacked.dequantize(), torch.from_numpy(np.concatenate([ref_a, ref_b])))
    perm = torch.tensor([3, 0, 7, 1, 2, 6, 5, 4])
    assert torch.equal(a.rows(perm).dequantize(), torch.from_numpy(ref_a)[perm])


# ---------------------------------------------------------------------------- in the model

# a format per matmul: Q4_1 and Q4_0 stack (both q4); gate Q8_0 with up Q4_1 do not, so
# gate_up keeps the float32 path while the other three read blocks
LAYER_TYPES = {
    "self_attn.q_proj": "Q4_1",
    "self_attn.k_proj": "Q4_0",
    "self_attn.v_proj": "Q4_1",
    "self_attn.o_proj": "Q8_0",
    "mlp.gate_proj": "Q8_0",
    "mlp.up_proj": "Q4_1",
    "mlp.down_proj": "Q4_1",
}


def _quantized_model(
    backend: AttentionBackend,
    types: dict[str, str] = LAYER_TYPES,
    dtype: torch.dtype = torch.float32,
    **config: object,
) -> tuple[LlamaForCausalLM, list[tuple[str, BlockQuantWeight]]]:
    """The tiny random model of test_decode_step (`config` overriding its sizes) with every
    matmul weight replaced by its dequantized GGUF blocks (in `dtype`, as the loader leaves
    them), and (for the caller to attach) the blocks, named as in the checkpoint."""
    model = _model(backend, dtype, **config)
    cfg = model.config
    q_n, kv_n = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    named = []
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            parts = {
                "self_attn.q_proj": layer.qkv_proj.plain[:q_n],
                "self_attn.k_proj": layer.qkv_proj.plain[q_n : q_n + kv_n],
                "self_attn.v_proj": layer.qkv_proj.plain[q_n + kv_n :],
                "self_attn.o_proj": layer.o_proj.plain,
                "mlp.gate_proj": layer.gate_up_proj.plain[:inter],
                "mlp.up_proj": layer.gate_up_proj.plain[inter:],
                "mlp.down_proj": layer.down_proj.plain,
            }
            for name, view in parts.items():
                blocks, ref = _blocks(view.float().numpy(), types[name])
                view.copy_(torch.from_numpy(ref))
                named.append((f"model.layers.{i}.{name}.weight", blocks))
        head, ref = _blocks(model.embed_tokens.float().numpy(), "Q8_0")
        model.embed_tokens.copy_(torch.from_numpy(ref))
        named.append(("model.embed_tokens.weight", head))
    return model, named


def _has_blocks(model: LlamaForCausalLM) -> bool:
    """Whether any matmul weight of the model (the LM head included) holds blocks."""
    return any(w.blocks is not None for _, w in model.matmul_weights())


ALL_Q4 = dict.fromkeys(LAYER_TYPES, "Q4_1")
BLOCK_TOKENS = 4  # KV block size of these tests
PROMPT_LENS = [3 + (5 * i) % 11 for i in range(16)]  # 3..13 tokens, up to 16 sequences


def _decode_run(model: LlamaForCausalLM, m: int, steps: int = 3) -> list[torch.Tensor]:
    """Prefills m prompts into scattered KV blocks, then runs `steps` decode steps of all m;
    returns every step's hidden states and logits and the final KV caches."""
    from sarazmq.kernels.metadata import AttentionMetadata
    from sarazmq.model.kv_cache import allocate_kv_cache

    lens = PROMPT_LENS[:m]
    per_seq = -(-(max(lens) + steps) // BLOCK_TOKENS)
    order = torch.randperm(m * per_seq, generator=torch.Generator().manual_seed(5)).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(m)]
    dtype = model.embed_tokens.dtype
    caches = allocate_kv_cache(model.config, m * per_seq, BLOCK_TOKENS, dtype, "cpu")
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, 96, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    model(ids, pos, caches, AttentionMetadata.build(lens, lens, tables, BLOCK_TOKENS))
    out = []
    for step in range(steps):
        k_lens = [n + step + 1 for n in lens]
        meta = AttentionMetadata.build([1] * m, k_lens, tables, BLOCK_TOKENS)
        ids = torch.tensor([(11 * step + 5 * i) % 96 for i in range(m)])
        hidden = model(ids, torch.tensor([n + step for n in lens]), caches, meta)
        out += [hidden, model.compute_logits(hidden)]
    return out + [t for kv in caches for t in kv]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "types,m",
    [(LAYER_TYPES, m) for m in (1, 2, 3, 5, 8)] + [(ALL_Q4, m) for m in (2, 12, 16)],
    ids=[f"mixed-{m}" for m in (1, 2, 3, 5, 8)] + [f"all-q4-{m}" for m in (2, 12, 16)],
)
def test_model_with_blocks_gives_bitwise_the_plain_results(
    dtype: torch.dtype, types: dict[str, str], m: int
) -> None:
    with_blocks, named = _quantized_model(CpuPagedAttention(), types, dtype)
    mixed = types is LAYER_TYPES
    assert with_blocks.load_block_quant_weights(named) == (3 * 3 + 1 if mixed else 3 * 4 + 1)
    kinds = {k: w.blocks and w.blocks.kind for k, w in with_blocks.layers[0].matmuls().items()}
    if mixed:
        assert kinds == {"qkv": "q4", "o": "q8", "gate_up": None, "down": "q4"}
    # the same weights, no blocks: the fused step on plain weights (bitwise the per-op
    # path up to 3 rows, tested in test_decode_step), and per op
    plain = _model(CpuPagedAttention(), dtype)
    plain.load_state_dict(with_blocks.state_dict())
    per_op = _model(PerOpCpuAttention(), dtype)
    per_op.load_state_dict(with_blocks.state_dict())
    # per op with blocks: rows within the matrix-vector kernel's range read the blocks
    per_op_blocks = _model(PerOpCpuAttention(), dtype)
    per_op_blocks.load_state_dict(with_blocks.state_dict())
    per_op_blocks.load_block_quant_weights(named)

    steps = []
    real_run = FusedDecodeStep.run

    def spy(self: FusedDecodeStep, *args: object) -> torch.Tensor | None:
        out = real_run(self, *args)  # type: ignore[arg-type]
        steps.append((self.block_quant, self.max_rows, out is not None))
        return out

    FusedDecodeStep.run = spy  # type: ignore[method-assign]
    try:
        runs = {
            name: _decode_run(model, m)
            for name, model in (
                ("blocks", with_blocks),
                ("plain", plain),
                ("per_op", per_op),
                ("per_op_blocks", per_op_blocks),
            )
        }
    finally:
        FusedDecodeStep.run = real_run  # type: ignore[method-assign]
    # a step whose every matmul reads blocks takes up to FUSED_MAX_ROWS_BLOCKS sequences;
    # one with some plain matmuls, and the plain model's, up to FUSED_MAX_ROWS
    plain_rows = FUSED_MAX_ROWS[dtype]
    blocks_rows = plain_rows if mixed else FUSED_MAX_ROWS_BLOCKS[dtype]
    blocks_fused, plain_fused = m <= blocks_rows, m <= plain_rows
    assert steps == [(True, blocks_rows, blocks_fused)] * 3 + [(False, plain_rows, plain_fused)] * 3

    def same(a: str, b: str) -> bool:
        return all(torch.equal(x, y) for x, y in zip(runs[a], runs[b], strict=True))

    def close(a: str, b: str) -> None:  # oneDNN's matmuls on one side: sums in another order
        tol = 1e-4 if dtype == torch.float32 else 0.05
        for x, y in zip(runs[a], runs[b], strict=True):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol)

    if GEMV_MAX_ROWS_BLOCKS[dtype] == GEMV_MAX_ROWS[dtype]:
        # per op, the blocks are read exactly where the plain kernel would run
        assert same("per_op_blocks", "per_op")
        if blocks_fused == plain_fused:
            assert same("blocks", "plain")
        else:
            close("blocks", "plain")
        if m <= GEMV_MAX_ROWS[dtype]:  # the plain kernel's rows: the two paths agree
            assert same("blocks", "per_op")
    else:
        # (AVX2 CPUs) per op, blocks go to the block kernel up to GEMV_MAX_ROWS_BLOCKS
        # rows, prefill rows included, where plain weights go to oneDNN
        close("per_op_blocks", "per_op")
        close("blocks", "plain")
    # the fused step and the per-op path run the same kernels wherever the per-op path
    # reads every matmul of a step as blocks (or the plain kernel for the plain ones)
    if m <= (GEMV_MAX_ROWS[dtype] if mixed else min(GEMV_MAX_ROWS_BLOCKS[dtype], blocks_rows)):
        assert same("blocks", "per_op_blocks")


def test_blocks_that_do_not_hold_the_weight_are_refused() -> None:
    model, good = _quantized_model(CpuPagedAttention())
    named = list(good)
    name, blocks = named[3]  # layer 0 o_proj
    bad_scales = blocks.scales.clone()
    bad_scales[0, 0] *= 2
    named[3] = (name, BlockQuantWeight(blocks.kind, blocks.qs, bad_scales))
    with pytest.raises(ValueError, match="layer 0 o_proj: the checkpoint's quantized blocks"):
        model.load_block_quant_weights(named)
    half = _model(CpuPagedAttention(), torch.float16)
    assert not half.wants_block_quant_weights()
    with pytest.raises(ValueError, match="float32 or bf16 CPU model"):
        half.load_block_quant_weights(good)
    # new weights drop the blocks of the old ones
    model.load_block_quant_weights(good)
    assert _has_blocks(model)
    model.random_init_(seed=1)
    assert not _has_blocks(model)


def test_gguf_file_blocks_are_kept_for_float32_and_bf16(tmp_path: Path) -> None:
    from test_model import _run_chunks, _save_hf, _write_tiny_gguf

    hf = _save_hf(tmp_path, "untied")  # llama: Q/K rows permuted in the file; own lm_head
    path = tmp_path / "q.gguf"
    _write_tiny_gguf(hf, path, "llama", quant={**LAYER_TYPES, "lm_head": "Q8_0"})
    source = resolve_model(str(path))
    config = load_model_config(source)
    model = load_model(source, config, torch.float32, "cpu", CpuPagedAttention())
    assert all(layer.qkv_proj.blocks is not None for layer in model.layers)
    assert model.layers[1].qkv_proj.blocks is not None
    assert model.layers[1].gate_up_proj.blocks is None
    assert model.lm_head.blocks is not None and model.lm_head.blocks.kind == "q8"
    # the file's dequantized weights (load_hf_weights) are what the blocks hold: checked
    # on load; and the model's logits are those of the same model without blocks
    ids = [5, 9, 2, 77, 31, 4, 18]
    with_blocks = _run_chunks(model, ids, chunk=1)  # one token at a time: decode rows
    model.clear_block_quant_weights()
    assert torch.equal(with_blocks, _run_chunks(model, ids, chunk=1))
    if block_quant_kernels_available(torch.bfloat16):
        # bf16: the blocks hold the weights rounded to bf16, and the results are the same
        bf16 = load_model(source, config, torch.bfloat16, "cpu", CpuPagedAttention())
        assert _has_blocks(bf16) and bf16.lm_head.blocks is not None
        with_blocks = _run_chunks(bf16, ids, chunk=1, dtype=torch.bfloat16)
        bf16.clear_block_quant_weights()
        assert torch.equal(with_blocks, _run_chunks(bf16, ids, chunk=1, dtype=torch.bfloat16))


def test_blocks_that_would_change_results_are_dropped_on_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a loader bug that garbled the blocks must cost speed, never results or the load
    from test_model import _save_hf, _write_tiny_gguf

    import sarazmq.model.loader as loader

    path = tmp_path / "q.gguf"
    _write_tiny_gguf(_save_hf(tmp_path, "llama"), path, "llama", quant=LAYER_TYPES)
    real = loader.iter_gguf_block_weights

    def garbled(*args: object) -> Iterator[tuple[str, BlockQuantWeight]]:
        # the blocks handed to the model only (the dequantized weights are read through
        # the same layout, so garbling that would change both alike)
        for name, w in real(*args):  # type: ignore[arg-type]
            yield name, BlockQuantWeight(w.kind, w.qs, w.scales * 2)

    monkeypatch.setattr(loader, "iter_gguf_block_weights", garbled)
    source = resolve_model(str(path))
    model = load_model(source, load_model_config(source), torch.float32, "cpu", CpuPagedAttention())
    assert not _has_blocks(model)
    assert "decode keeps the dequantized weights" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", [CpuPagedAttention, PerOpCpuAttention, TorchPagedAttention])
@pytest.mark.parametrize("types", [ALL_Q4, LAYER_TYPES], ids=["all-q4", "mixed"])
def test_dropping_unused_plain_weights_changes_no_result(
    dtype: torch.dtype, backend: type, types: dict[str, str]
) -> None:
    # what build_model_runner does after prepacking: the plain copies no path reads any
    # more go, and every step (prefill, fused and per-op decodes, logits) stays bitwise
    if not can_prepack_linear(dtype, "cpu"):
        pytest.skip("no oneDNN prepacking for this dtype (torch build or CPU)")
    runs = {}
    for drop in (False, True):
        model, named = _quantized_model(backend(), types, dtype)
        model.load_block_quant_weights(named)
        assert model.prepack_linear_weights()
        held = model.weight_bytes()
        if drop:
            layers = model.config.num_layers
            # the torch ops read the packed copies only; the native ones also the plain
            # weight of a matmul without blocks (gate_up in "mixed"); the tied LM head is
            # the embedding table
            want = 4 * layers if backend is TorchPagedAttention or types is ALL_Q4 else 3 * layers
            assert model.drop_unused_plain_weights() == want
            freed = held["plain"] - model.weight_bytes()["plain"]
            kept = sum(w.variant_bytes()["plain"] for _, w in model.matmul_weights())
            assert freed > 0 and kept == held["plain"] - freed
            assert model.lm_head.has_plain  # the embedding table stays
            assert model.drop_unused_plain_weights() == 0
        runs[drop] = [t for m in (1, 3, 5, 12) for t in _decode_run(model, m)]
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
