"""Decode steps through `DecodeGraphs` (sarazmq.worker.cuda_graphs) against the plain path.

Without a GPU nothing is captured: `capture=False` runs the same padded static buffers
eagerly, with the Triton backend under its interpreter (the backend graphs are captured
with on CUDA). So what is checked here is everything but the capture itself: padding to
the ladder's sizes, the static inputs, the skipped KV writes of padding rows, and that a
runner's results do not change. The capture and its speed are scripts/gpu_check.py's.
"""

from __future__ import annotations

import pytest
import torch
from test_model import _tiny_config
from triton_interpreted import interpreted_kernels

from sarazmq.config import EngineConfig
from sarazmq.kernels import TritonPagedAttention
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.options import EngineOptions
from sarazmq.protocol.worker import BatchPlan, NewSeq, ScheduledSeq
from sarazmq.sampling_params import SamplingParams
from sarazmq.worker.cuda_graphs import DecodeGraphs, capture_sizes
from sarazmq.worker.model_runner import ModelRunner
from sarazmq.worker.sampler import Sampler

interpreted_kernels("triton_attention", "triton_ops")  # what TritonPagedAttention loads

BLOCK = 4
MAX_BLOCKS = 6  # 24 positions a sequence
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_capture_sizes_follow_the_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_batch=0 must be >= 1"):
        capture_sizes(0)


def _runner(graphs: bool) -> ModelRunner:
    config = _tiny_config()
    model = LlamaForCausalLM(config, TritonPagedAttention(BLOCK))
    model.random_init_(seed=3)
    caches = allocate_kv_cache(config, 40, BLOCK, torch.float32, "cpu")
    decode_graphs = (
        DecodeGraphs(model, caches, BLOCK, 8, MAX_BLOCKS, CPU, capture=False) if graphs else None
    )
    return ModelRunner(model, caches, BLOCK, Sampler([]), CPU, decode_graphs=decode_graphs)


def _drive(runner: ModelRunner) -> list[tuple[list[int], list[float]]]:
    """Five prompts: three prefilled first, then decoding (3 rows, padded to 4) while the
    other two prefill in hybrid steps, then all five decoding (padded to 8). Returns each
    step's sampled tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 2], [7, 1, 1, 3, 8, 2], [4], [11, 12, 13, 14, 15], [6, 6]]
    # sequence i owns blocks 1 + 6i .. 6 + 6i; block 0 is what padding rows read
    blocks = {i: list(range(1 + 6 * i, 7 + 6 * i)) for i in range(5)}
    known = {i: len(p) for i, p in enumerate(prompts)}
    computed = dict.fromkeys(range(5), 0)
    last: dict[int, int] = {}
    out = []

    def item(i: int, n: int) -> ScheduledSeq:
        start = computed[i]
        new_blocks = blocks[i][(start + BLOCK - 1) // BLOCK : (start + n + BLOCK - 1) // BLOCK]
        append = [last.pop(i)] if i in last else []
        computed[i] += n
        return ScheduledSeq(i, start, n, append, new_blocks, sample=True)

    new = [NewSeq(i, p, len(p), params, 0) for i, p in enumerate(prompts)]
    steps = [[(0, 3), (1, 6), (2, 1)]]  # (seq, tokens) scheduled per step
    steps += [[(0, 1), (1, 1), (2, 1)]] * 2
    steps += [[(0, 1), (1, 1), (2, 1), (3, 5), (4, 2)]]
    steps += [[(i, 1) for i in range(5)]] * 4
    for n, step in enumerate(steps):
        plan = BatchPlan(
            step=n, new_seqs=new if n == 0 else [], scheduled=[item(i, k) for i, k in step]
        )
        result = runner.execute(plan)
        for seq, token in zip(result.seq_ids, result.token_ids, strict=True):
            last[seq] = token
            known[seq] += 1
        logprobs = [lp.logprob for lp in result.logprobs if lp is not None]
        out.append((result.token_ids, logprobs))
    return out


def test_decode_steps_through_the_graph_buffers_match_the_plain_path() -> None:
    plain, padded = _runner(graphs=False), _runner(graphs=True)
    expected, got = _drive(plain), _drive(padded)
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(expected, got, strict=True):
        assert tokens_a == tokens_b
        torch.testing.assert_close(torch.tensor(lp_b), torch.tensor(lp_a), atol=1e-5, rtol=0)
    graphs = padded.decode_graphs
    assert graphs is not None and graphs.captured_sizes == [4, 8]  # 3 -> 4 and 5 -> 8 rows
    # padding rows write no KV: the block they read (0) and every block no sequence owns
    # are untouched in both runners' caches
    for k_cache, v_cache in padded.kv_caches:
        assert not k_cache[0].any() and not v_cache[0].any()
        assert not k_cache[31:].any() and not v_cache[31:].any()
    for (k_a, v_a), (k_b, v_b) in zip(plain.kv_caches, padded.kv_caches, strict=True):
        torch.testing.assert_close(k_b, k_a, atol=1e-6, rtol=0)
        torch.testing.assert_close(v_b, v_a, atol=1e-6, rtol=0)


def test_setting_up_every_size_at_startup_writes_no_kv_and_changes_nothing() -> None:
    # what a CUDA worker does at startup (capture_all), here eagerly: batches of padding
    # rows only, whose KV writes are all skipped
    runner = _runner(graphs=True)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert graphs.capture_all() >= 0.0
    assert graphs.captured_sizes == [1, 2, 4, 8]
    for k_cache, v_cache in runner.kv_caches:
        assert not k_cache.any() and not v_cache.any()
    expected = _drive(_runner(graphs=False))
    assert [tokens for tokens, _ in _drive(runner)] == [tokens for tokens, _ in expected]


def test_batches_the_graphs_do_not_take_are_refused_or_run_op_by_op() -> None:
    runner = _runner(graphs=True)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert graphs.takes(8, MAX_BLOCKS) and not graphs.takes(9, 1)
    assert not graphs.takes(1, MAX_BLOCKS + 1) and not graphs.takes(0, 1)
    assert [graphs.padded_size(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match=r"take 1\.\.8 sequences of at most 6 blocks"):
        graphs.run([1] * 9, [1] * 9, [[0]] * 9)
    with pytest.raises(ValueError, match="need a CUDA device, not cpu"):
        DecodeGraphs(runner.model, runner.kv_caches, BLOCK, 8, MAX_BLOCKS, CPU)


def test_the_option_reaches_the_config_and_is_checked() -> None:
    assert EngineOptions(cuda_graph_max_batch=16).to_config().cuda_graph_max_batch == 16
    assert EngineConfig().cuda_graph_max_batch == 128
    with pytest.raises(ValueError, match="cuda_graph_max_batch=-1 must be >= 0"):
        EngineOptions(cuda_graph_max_batch=-1).to_config()
