"""Token-by-token agreement of two ways of computing a model (sarazmq.perf.token_agreement):
the measures against hand-computed values, and teacher-forced logits against a single
pass, chunk by chunk."""

from __future__ import annotations

import math

import pytest
import torch
from test_model import _tiny_config

from sarazmq.kernels import TorchPagedAttention
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.perf.token_agreement import compare, pooled, teacher_forced_logits


def test_identical_logits_agree_fully_and_perplexity_is_by_hand() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    ids = [0, 1, 2]
    a = compare(logits, logits.clone(), ids)
    assert a.positions == 3 and a.top1_agreement == 1.0
    assert a.mean_kl == 0.0 == a.max_kl
    # next tokens 1 (from row 0) and 2 (from row 1)
    p1 = math.exp(0.0) / (math.exp(2.0) + 2)
    p2 = math.exp(0.0) / (math.exp(1.0) + 2)
    assert a.perplexity == pytest.approx(math.exp(-(math.log(p1) + math.log(p2)) / 2))


def test_kl_and_top1_against_hand_values() -> None:
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    out = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    a = compare(ref, out, [0, 1])
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert a.mean_kl == pytest.approx(kl0 / 2)
    assert a.max_kl == pytest.approx(kl0)
    assert a.top1_agreement == 0.5  # row 0: a tie goes to index 0 in ref, 1 in out
    # pooled weighs every position the same, wherever its text is
    b = pooled([(ref[:1].repeat(2, 1), out[:1].repeat(2, 1), [0, 1]), (ref, ref, [0, 1])])
    assert b.positions == 4 and b.mean_kl == pytest.approx(kl0 / 2)
    assert b.top1_agreement == 0.5


@pytest.mark.parametrize(
    ("ref_shape", "out_shape", "ids"),
    [((3, 4), (3, 5), [0, 1, 2]), ((3, 4), (3, 4), [0, 1]), ((1, 4), (1, 4), [0])],
)
def test_mismatches_are_refused(ref_shape: tuple, out_shape: tuple, ids: list[int]) -> None:
    with pytest.raises(ValueError, match="shapes differ|need >= 2 ids"):
        compare(torch.zeros(ref_shape), torch.zeros(out_shape), ids)
    with pytest.raises(ValueError, match="no texts"):
        pooled([])


def test_teacher_forced_logits_are_the_single_pass_in_any_chunks() -> None:
    config = _tiny_config(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2)
    model = LlamaForCausalLM(config, TorchPagedAttention())
    model.random_init_(seed=3, std=0.3)
    ids = torch.randint(0, 64, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = teacher_forced_logits(model, ids, chunk=64)
    assert whole.shape == (37, 64) and whole.dtype == torch.float32
    for chunk in (1, 5, 16):
        torch.testing.assert_close(teacher_forced_logits(model, ids, chunk), whole)
    # row i sees ids[: i + 1] only: a different later token changes nothing before it
    changed = ids[:20] + [(ids[20] + 1) % 64] + ids[21:]
    other = teacher_forced_logits(model, changed, chunk=8)
    torch.testing.assert_close(other[:20], whole[:20])
    assert not torch.allclose(other[20], whole[20])
    with pytest.raises(ValueError, match="non-empty"):
        teacher_forced_logits(model, [], chunk=4)
    # through an int8 KV cache: close to the model's own cache, not the same
    on_int8 = teacher_forced_logits(model, ids, chunk=16, kv_cache_dtype="int8")
    assert on_int8.shape == whole.shape and not torch.equal(on_int8, whole)
    near = compare(whole, on_int8, ids)
    assert near.mean_kl < 1e-3 and near.top1_agreement >= 0.9
