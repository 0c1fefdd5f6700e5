"""The fused decode step with gguf_matmul="int8" (kernels/csrc/decode_step.c reading the
Q4 matmuls as int8 panels): decode-only steps compute what the per-op int8 path computes,
bit for bit (the same quantizer and panel kernel, called in the same order), and that is
llama.cpp's precision, close to but not the float path's."""

from __future__ import annotations

import pytest
import torch
from test_block_quant import ALL_Q4, _decode_run, _quantized_model
from test_decode_step import PerOpCpuAttention

from sarazmq.kernels import CpuPagedAttention
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available
from sarazmq.kernels.decode_step import FusedDecodeStep, StepSizes
from sarazmq.kernels.int8_dot import int8_dot_avx2
from sarazmq.model.step_weights import decode_step_weights

pytestmark = pytest.mark.skipif(
    not cpu_attention_available(), reason="native CPU kernels unavailable (no C compiler)"
)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_fused_int8_step_is_the_per_op_int8_path(m: int) -> None:
    fused, named = _quantized_model(CpuPagedAttention(), ALL_Q4)
    per_op, _ = _quantized_model(PerOpCpuAttention(), ALL_Q4)
    per_op.load_state_dict(fused.state_dict())
    float_model, _ = _quantized_model(CpuPagedAttention(), ALL_Q4)
    float_model.load_state_dict(fused.state_dict())
    for model in (fused, per_op, float_model):
        model.load_block_quant_weights(named)
    # every layer matmul (Q4) takes panels; the Q8 LM head keeps its block layout
    assert fused.set_gguf_matmul("int8") == per_op.set_gguf_matmul("int8") == 3 * 4 + 1
    assert all(w.int8_panels is not None for w in fused.layers[0].matmuls().values())

    steps: list[tuple[bool, bool]] = []
    real_run = FusedDecodeStep.run

    def spy(self: FusedDecodeStep, *args: object) -> torch.Tensor | None:
        out = real_run(self, *args)  # type: ignore[arg-type]
        steps.append((self.int8, out is not None))
        return out

    FusedDecodeStep.run = spy  # type: ignore[method-assign]
    try:
        got = _decode_run(fused, m)
        float_run = _decode_run(float_model, m)
    finally:
        FusedDecodeStep.run = real_run  # type: ignore[method-assign]
    assert steps == [(True, True)] * 3 + [(False, True)] * 3
    want = _decode_run(per_op, m)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # llama.cpp's precision: the hidden states of the last step within a few percent of
    # the float path's, and not equal to them
    hidden, ref = got[-4], float_run[-4]
    rel = float((hidden - ref).norm() / ref.norm())
    assert 0 < rel < 0.05, rel


def test_switching_back_to_float_rebuilds_the_float_step() -> None:
    model, named = _quantized_model(CpuPagedAttention(), ALL_Q4)
    model.load_block_quant_weights(named)
    reference, _ = _quantized_model(CpuPagedAttention(), ALL_Q4)
    reference.load_state_dict(model.state_dict())
    reference.load_block_quant_weights(named)
    model.set_gguf_matmul("int8")
    int8_run = _decode_run(model, 4)
    assert model.set_gguf_matmul("float") == 0
    assert all(w.int8_panels is None for _, w in model.matmul_weights())
    back = _decode_run(model, 4)
    want = _decode_run(reference, 4)
    assert all(torch.equal(a, b) for a, b in zip(back, want, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(int8_run, want, strict=True))


@pytest.mark.skipif(not int8_dot_avx2(), reason="the AVX2 int8 kernels are not built")
def test_a_bf16_step_refuses_int8_panels() -> None:
    model, named = _quantized_model(CpuPagedAttention(), ALL_Q4)
    model.load_block_quant_weights(named)
    model.set_gguf_matmul("int8")
    layers = decode_step_weights(model.layers)
    assert layers is not None
    caches = [
        (
            torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16),
            torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16),
        )
        for _ in layers
    ]
    with pytest.raises(ValueError, match="int8 panels need a float32 model"):
        FusedDecodeStep(layers, model.norm.bfloat16(), caches, StepSizes(4, 2, 16, 1e-5, 0.25))
