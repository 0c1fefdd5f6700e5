"""The one-call hybrid iteration (kernels/csrc/hybrid_step.c, sarazmq.kernels.hybrid_step):
a bf16 Llama iteration of decodes and prefill chunks, matmuls on AMX tiles, must give
bitwise the per-op path's hidden states and KV caches, be what the model runs for such
batches, decline what it does not cover, and turn a bad plan into an error that writes
nothing."""

from __future__ import annotations

import pytest
import torch
from test_model import _tiny_config

from sarazmq.config import ModelConfig
from sarazmq.kernels import CpuPagedAttention
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available, prefill_amx_available
from sarazmq.kernels.hybrid_step import HybridStep
from sarazmq.kernels.linear_amx import amx_linear_available
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not (cpu_attention_available() and prefill_amx_available() and amx_linear_available()),
    reason="needs the native kernels on a CPU with AMX tiles",
)

BLOCK = 16
NUM_BLOCKS = 40


class PerOpCpuAttention(CpuPagedAttention):
    """The CPU backend with neither one-call step: every op on its own."""

    def fused_decode_step(self, *args: object, **kwargs: object) -> None:
        return None

    def hybrid_step(self, *args: object, **kwargs: object) -> None:
        return None


class NoFusedDecode(CpuPagedAttention):
    """The CPU backend whose decode-only batches of a few rows also take the hybrid step."""

    def fused_decode_step(self, *args: object, **kwargs: object) -> None:
        return None


def tiny_config(**over: object) -> ModelConfig:
    # the smallest shapes the AMX kernels take: head size 64, every matmul side % 32 == 0
    base = dict(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=96,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        max_position=256,
    )
    base.update(over)
    return _tiny_config(**base)


def _model(backend: CpuPagedAttention, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_config(), backend, dtype=dtype)
    model.random_init_(seed=3, std=0.3)  # weights big enough that every op matters
    model.prepack_linear_weights()
    return model


# (q_len, k_len, block table) per sequence, decodes first: first chunks, then chunks over
# their context with decodes beside them, then decodes only
TABLES = ([5, 31, 12, 7, 38], [22, 3, 18], [9, 27, 14, 1, 36], [30, 11])
ITERATIONS = (
    [(40, 40, 0), (17, 17, 1)],
    [(1, 18, 1), (33, 73, 0), (5, 5, 2)],
    [(1, 19, 1), (1, 74, 0), (60, 65, 2), (2, 2, 3)],
    [(1, 20, 1), (1, 75, 0), (1, 66, 2), (1, 3, 3)],
)


def _batch(step: list[tuple[int, int, int]], seed: int) -> tuple:
    q_lens = [q for q, _, _ in step]
    k_lens = [k for _, k, _ in step]
    meta = AttentionMetadata.build(q_lens, k_lens, [list(TABLES[s]) for _, _, s in step], BLOCK)
    ids = torch.randint(0, 96, (sum(q_lens),), generator=torch.Generator().manual_seed(seed))
    return ids, meta.positions, meta


def _run(model: LlamaForCausalLM, caches: list) -> list[torch.Tensor]:
    outs = []
    for i, step in enumerate(ITERATIONS):
        ids, positions, meta = _batch(step, i)
        outs.append(model(ids, positions, caches, meta))
    return outs


def _caches(kv_cache_dtype: str = "auto") -> list:
    return allocate_kv_cache(
        tiny_config(), NUM_BLOCKS, BLOCK, torch.bfloat16, "cpu", kv_cache_dtype=kv_cache_dtype
    )


def count_hybrid_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every `HybridStep.run` from now on (-1 where it declined)."""
    rows: list[int] = []
    real_run = HybridStep.run

    def counting_run(self: HybridStep, x: torch.Tensor, *args: object) -> torch.Tensor | None:
        out = real_run(self, x, *args)  # type: ignore[arg-type]
        rows.append(x.shape[0] if out is not None else -1)
        return out

    monkeypatch.setattr(HybridStep, "run", counting_run)
    return rows


def assert_bitwise_equal(outs_a: list, outs_b: list, caches_a: list, caches_b: list) -> None:
    """The same hidden states, and the same bytes in every KV cache."""
    for a, b in zip(outs_a, outs_b, strict=True):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("backend", [CpuPagedAttention, NoFusedDecode])
def test_hybrid_iterations_are_bitwise_the_per_op_path(
    backend: type[CpuPagedAttention], kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 caches, and int8 ones (written and read by the int8 kernels, each chunk's
    context dequantized for the prefill kernel): the same hidden states and cache bytes."""
    one_call = _model(backend())
    per_op = _model(PerOpCpuAttention())
    caches_a, caches_b = _caches(kv_cache_dtype), _caches(kv_cache_dtype)
    rows = count_hybrid_rows(monkeypatch)
    outs_a = _run(one_call, caches_a)
    assert rows and -1 not in rows  # every multi-row batch took the one-call step
    assert per_op.hybrid_step(caches_b) is None
    outs_b = _run(per_op, caches_b)
    assert_bitwise_equal(outs_a, outs_b, caches_a, caches_b)
    # decode-only batches of a few rows are the fused decode step's where the backend has it
    expected = [57, 39, 64, 4] if backend is NoFusedDecode else [57, 39, 64]
    assert rows == expected


def test_a_block_outside_the_cache_is_an_error_that_writes_nothing() -> None:
    model = _model(CpuPagedAttention())
    caches = _caches()
    step = model.hybrid_step(caches)
    assert step is not None
    meta = AttentionMetadata.build([3, 1], [3, 9], [[NUM_BLOCKS], [0]], BLOCK)
    x = torch.randn(4, 128).to(torch.bfloat16)
    cos = torch.ones(4, 1, 64, dtype=torch.bfloat16)
    before = [(k.clone(), v.clone()) for k, v in caches]
    with pytest.raises(IndexError, match="outside the KV cache"):
        step.run(x, cos, cos, meta)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_declines_what_it_does_not_cover() -> None:
    model = _model(CpuPagedAttention())
    caches = _caches()
    step = model.hybrid_step(caches)
    assert step is not None
    meta = AttentionMetadata.build([1], [5], [[0]], BLOCK)
    one = torch.randn(1, 128).to(torch.bfloat16)
    cos = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    assert step.run(one, cos, cos, meta) is None  # one row: the matrix-vector kernel's
    meta2 = AttentionMetadata.build([2], [2], [[0]], BLOCK)
    two = torch.randn(2, 128)
    cos2 = torch.ones(2, 1, 64)
    assert step.run(two, cos2, cos2, meta2) is None  # float32 rows
    # no tile layouts (not prepacked), or float32 weights: no step at all
    unpacked = LlamaForCausalLM(tiny_config(), CpuPagedAttention(), dtype=torch.bfloat16)
    unpacked.random_init_(seed=3)
    assert unpacked.hybrid_step(caches) is None
    f32 = _model(CpuPagedAttention(), dtype=torch.float32)
    assert f32.hybrid_step(allocate_kv_cache(tiny_config(), 4, BLOCK, torch.float32, "cpu")) is None
    # caches partly int8: no step (all int8 take it: the bitwise test above)
    int8 = allocate_kv_cache(tiny_config(), 4, BLOCK, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    bf16 = allocate_kv_cache(tiny_config(), 4, BLOCK, torch.bfloat16, "cpu")
    assert model.hybrid_step(int8[:1] + bf16[1:]) is None
    assert model.hybrid_step(int8) is not None
