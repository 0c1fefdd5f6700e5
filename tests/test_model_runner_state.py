"""The model runner's public view of its sequences (`sequence_ids`, `sequence`) and the
benchmarks' way to skip a prefill (`assume_computed`), on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from test_model import _tiny_config

from sarazmq.kernels import TorchPagedAttention
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq
from sarazmq.sampling_params import SamplingParams
from sarazmq.worker.model_runner import ModelRunner, PlanError

BLOCK = 4


def _runner() -> ModelRunner:
    config = _tiny_config()
    model = LlamaForCausalLM(config, TorchPagedAttention())
    model.random_init_(seed=0)
    caches = allocate_kv_cache(config, 16, BLOCK, torch.float32, "cpu")
    return ModelRunner(model, caches, BLOCK, None, torch.device("cpu"))


def test_sequences_are_read_and_assumed_computed_through_the_public_api() -> None:
    runner = _runner()
    params = SamplingParams(temperature=0, max_tokens=1)
    tokens = list(range(3, 13))  # 10 tokens
    runner.execute(
        BatchPlan(step=1, new_seqs=[NewSeq(7, tokens, 10, params, 0), NewSeq(9, [5], 1, params, 0)])
    )
    assert runner.sequence_ids() == [7, 9]
    state = runner.sequence(7)
    assert state.token_ids == tokens and state.num_computed == 0 and state.block_ids == []
    with pytest.raises(KeyError):
        runner.sequence(8)
    # the first 9 positions declared computed in blocks 5, 2, 11: a decode at position 9
    runner.assume_computed(7, 9, [5, 2, 11])
    assert (state.num_computed, state.block_ids) == (9, [5, 2, 11])
    runner.execute(BatchPlan(step=2, scheduled=[ScheduledSeq(7, 9, 1, sample=False)]))
    assert runner.sequence(7).num_computed == 10
    with pytest.raises(PlanError, match="start_pos 9 != computed 10"):
        runner.execute(BatchPlan(step=3, scheduled=[ScheduledSeq(7, 9, 1, sample=False)]))
    with pytest.raises(ValueError, match="unknown seq_id 8"):
        runner.assume_computed(8, 1, [0])
    with pytest.raises(ValueError, match="outside the sequence's 10 tokens"):
        runner.assume_computed(7, 11, [5, 2, 11])
    with pytest.raises(ValueError, match="2 blocks of 4 tokens cannot hold 9 positions"):
        runner.assume_computed(7, 9, [5, 2])
    runner.execute(BatchPlan(step=4, freed_seq_ids=[7]))
    assert runner.sequence_ids() == [9]
