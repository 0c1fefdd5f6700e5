"""Per-iteration behaviour of each batching policy, checked on every iteration of
workloads driven by the fake worker (see scheduler_harness)."""

from __future__ import annotations

import pytest
from scheduler_harness import IterInfo, drive

from sarazmq.config import POLICIES, SchedulerConfig
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import POLICY_CLASSES, Scheduler, make_policy


def make(
    policy: str,
    *,
    chunk_size: int = 16,
    max_num_seqs: int = 16,
    watermark: float = 0.0,
    block_size: int = 4,
    num_blocks: int = 1024,
    max_model_len: int = 128,
) -> Scheduler:
    cfg = SchedulerConfig(
        policy=policy, chunk_size=chunk_size, max_num_seqs=max_num_seqs, watermark=watermark
    )
    return Scheduler(cfg, block_size, num_blocks, max_model_len, eos_token_ids=(2,), seed=0)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def mixed_workload(n: int = 12) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Staggered arrivals, prompt lengths 3..40, output lengths 2..14."""
    arrivals: dict[int, list] = {}
    for i in range(n):
        plen = 3 + (i * 11) % 38
        arrivals.setdefault(2 * (i // 2), []).append(
            (f"r{i}", [50 + (i + j) % 40 for j in range(plen)], params(2 + (i * 5) % 13))
        )
    return arrivals


def kinds(iters: list[IterInfo]) -> list[str]:
    return [it.kind for it in iters]


def test_make_policy_by_name() -> None:
    for name in POLICIES:
        pol = make_policy(SchedulerConfig(policy=name), max_model_len=64)
        assert pol.name == name and isinstance(pol, POLICY_CLASSES[name])
    assert set(POLICY_CLASSES) == set(POLICIES)


# ---------------------------------------------------------------- sarathi


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_sarathi_stall_free_and_within_budget(chunk_size: int) -> None:
    def check(sched: Scheduler, it: IterInfo) -> None:
        assert not it.preempted  # roomy pool
        # no running decode is ever left out
        assert set(it.running_decodes_before) == set(it.decode_seqs)
        # prefill tokens never exceed what the decodes leave of the budget
        assert it.num_prefill_tokens <= max(0, chunk_size - len(it.decode_seqs))
        # running chunked prefills continue, oldest first, before anything new
        ids = [sid for sid, _, _ in it.prefill_chunks]
        cont = [sid for sid in ids if sid in it.running_prefills_before]
        assert ids[: len(cont)] == cont == sorted(cont)
        # and they fill the budget before a new prompt gets any
        if len(ids) > len(cont):
            assert set(cont) == set(it.running_prefills_before)

    res = drive(make("sarathi", chunk_size=chunk_size), mixed_workload(), on_iter=check)
    if chunk_size >= 5:
        assert "mixed" in kinds(res.iters)  # hybrid batches happen
    if 1 < chunk_size <= 16:  # the budget gets filled exactly
        assert any(it.num_prefill_tokens + len(it.decode_seqs) == chunk_size for it in res.iters)


def test_sarathi_several_prefills_share_a_batch_last_cut() -> None:
    sched = make("sarathi", chunk_size=64)
    arrivals = {0: [(f"r{i}", [10 + i] * 20, params(5)) for i in range(5)]}
    res = drive(sched, arrivals)
    first, second = res.iters[0], res.iters[1]
    assert first.prefill_chunks == [(0, 0, 20), (1, 0, 20), (2, 0, 20), (3, 0, 4)]
    assert [ns.seq_id for ns in first.plan.new_seqs] == [0, 1, 2, 3]
    # next: 3 decodes, r3's remaining 16, then r4 whole: 3 + 16 + 20 <= 64
    assert second.decode_seqs == [0, 1, 2]
    assert second.prefill_chunks == [(3, 4, 16), (4, 0, 20)]


def test_sarathi_decodes_alone_over_budget_stall_prefills() -> None:
    sched = make("sarathi", chunk_size=3)
    arrivals = {0: [(f"r{i}", [7, 8], params(12)) for i in range(5)]}
    res = drive(sched, arrivals)
    starved = [
        it
        for it in res.iters
        if len(it.decode_seqs) >= 3 and (it.num_waiting_before or it.running_prefills_before)
    ]
    assert starved and all(not it.prefill_chunks for it in starved)


def test_sarathi_admission_needs_whole_prompt_blocks() -> None:
    # 40 slots; r0 takes 8 blocks at admission, r1 needs 3 but only 2 are free
    sched = make("sarathi", chunk_size=64, block_size=4, num_blocks=10)
    arrivals = {0: [("r0", [5] * 30, params(2)), ("r1", [6] * 12, params(2))]}
    res = drive(sched, arrivals)
    assert res.iters[0].prefill_chunks == [(0, 0, 30)]  # budget left, blocks not
    assert [ns.seq_id for ns in res.iters[0].plan.new_seqs] == [0]
    later = [i for i, it in enumerate(res.iters) if any(ns.seq_id == 1 for ns in it.plan.new_seqs)]
    assert later and later[0] > 0 and res.iters[later[0]].free_blocks_before >= 3


@pytest.mark.parametrize(("watermark", "admitted_together"), [(0.0, True), (0.1, False)])
def test_watermark_at_admission(watermark: float, admitted_together: bool) -> None:
    # 100 blocks of 1 token; r0 takes 85 -> 15 free; r1 needs 6 (+10 with watermark 0.1)
    sched = make("sarathi", chunk_size=128, block_size=1, num_blocks=100, watermark=watermark)
    arrivals = {0: [("r0", [5] * 85, params(2)), ("r1", [6] * 6, params(2))]}
    res = drive(sched, arrivals)
    assert (len(res.iters[0].plan.new_seqs) == 2) == admitted_together


def test_watermark_waived_when_nothing_runs() -> None:
    sched = make("sarathi", chunk_size=128, block_size=1, num_blocks=100, watermark=0.5)
    res = drive(sched, {0: [("r0", [5] * 100, params(1))]})
    assert res.finish == {"r0": "length"}


def test_max_num_seqs_respected_everywhere() -> None:
    for policy in POLICIES:
        sched = make(policy, max_num_seqs=3)

        def check(s: Scheduler, it: IterInfo) -> None:
            assert len(s.running) <= 3

        drive(sched, mixed_workload(), on_iter=check)


# ---------------------------------------------------------------- vllm


def test_vllm_prefill_first_never_mixes() -> None:
    chunk, mml = 16, 64

    def check(sched: Scheduler, it: IterInfo) -> None:
        assert it.kind != "mixed"
        if it.kind == "prefill":
            # whole prompts only, within max(chunk_size, max_model_len) tokens
            assert all(start == 0 for _, start, _ in it.prefill_chunks)
            assert all(
                n == len(ns.token_ids)
                for (_, _, n), ns in zip(it.prefill_chunks, it.plan.new_seqs, strict=True)
            )
            assert it.num_prefill_tokens <= max(chunk, mml)
        else:
            assert set(it.decode_seqs) == set(it.running_decodes_before)

    res = drive(make("vllm", chunk_size=chunk, max_model_len=mml), mixed_workload(), on_iter=check)
    # decodes stall while prefills run
    assert any(it.kind == "prefill" and it.running_decodes_before for it in res.iters)
    # several whole prefills in one batch beyond chunk_size
    assert any(it.num_prefill_tokens > chunk for it in res.iters)


def test_vllm_token_budget_splits_prefill_batches() -> None:
    sched = make("vllm", chunk_size=16, max_model_len=40)
    arrivals = {
        0: [("a", [5] * 30, params(3)), ("b", [6] * 30, params(3)), ("c", [7] * 9, params(3))]
    }
    res = drive(sched, arrivals)
    assert res.iters[0].prefill_chunks == [(0, 0, 30)]  # 30 + 30 > 40: FCFS, b waits
    assert res.iters[1].prefill_chunks == [(1, 0, 30), (2, 0, 9)]  # 39 <= 40


# ---------------------------------------------------------------- orca


def test_orca_whole_prompts_beside_decodes() -> None:
    chunk = 8

    def check(sched: Scheduler, it: IterInfo) -> None:
        assert set(it.decode_seqs) == set(it.running_decodes_before)
        assert all(start == 0 for _, start, _ in it.prefill_chunks)
        assert not it.running_prefills_before  # nothing is ever half-prefilled

    res = drive(make("orca", chunk_size=chunk), mixed_workload(), on_iter=check)
    assert "mixed" in kinds(res.iters)
    assert any(it.num_prefill_tokens + len(it.decode_seqs) > chunk for it in res.iters)


# ---------------------------------------------------------------- fastertransformer


def test_fastertransformer_static_batches() -> None:
    def check(sched: Scheduler, it: IterInfo) -> None:
        if it.plan.new_seqs:
            assert it.num_running_before == 0  # admits only into an empty batch
            assert not it.decode_seqs
            assert all(start == 0 for _, start, _ in it.prefill_chunks)
        else:
            assert it.kind == "decode"
            assert set(it.decode_seqs) == set(it.running_decodes_before)

    res = drive(make("fastertransformer"), mixed_workload(), on_iter=check)
    batches = [it for it in res.iters if it.plan.new_seqs]
    assert len(batches) >= 2 and any(len(b.plan.new_seqs) > 1 for b in batches)
    # requests that arrived while a batch ran waited for it to drain
    assert any(it.num_waiting_before and it.kind == "decode" for it in res.iters)


# ---------------------------------------------------------------- simple_chunking


def test_simple_chunking_alternates() -> None:
    chunk = 8

    def check(sched: Scheduler, it: IterInfo) -> None:
        assert it.kind != "mixed"
        assert it.num_prefill_tokens <= chunk

    res = drive(make("simple_chunking", chunk_size=chunk), mixed_workload(), on_iter=check)
    ks = kinds(res.iters)
    for prev, cur, it in zip(ks, ks[1:], res.iters[1:], strict=False):
        has_decode_work = bool(it.running_decodes_before)
        # roomy pool: any waiting request is admissible
        has_prefill_work = bool(it.running_prefills_before or it.num_waiting_before)
        if has_decode_work and has_prefill_work:
            assert cur != prev, "both kinds have work: must alternate"
        elif has_decode_work:
            assert cur == "decode"
        else:
            assert cur == "prefill"
    assert "prefill" in ks and "decode" in ks
    # a 41-token prompt is split into chunks of at most 8
    assert any(n == chunk and start > 0 for it in res.iters for _, start, n in it.prefill_chunks)


# ---------------------------------------------------------------- token budget records


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_iteration_records_carry_the_policys_token_budget(policy: str) -> None:
    """What the dashboard draws as unused budget: every iteration record says the token
    budget its policy worked under, and the iteration never holds more than it."""
    sched = make(policy, chunk_size=16, max_model_len=128)
    drive(sched, mixed_workload())
    records = list(sched.iteration_records)
    assert records
    for rec in records:
        tokens = rec.num_prefill_tokens + rec.num_decode_tokens
        prefill_only = rec.num_prefill_tokens and not rec.num_decode_tokens
        if policy == "sarathi":  # chunk_size, or all decodes when they alone exceed it
            assert rec.token_budget == max(16, rec.num_decode_tokens)
        elif policy == "vllm":  # whole-prompt batches up to max_model_len; decodes unbounded
            assert rec.token_budget == (128 if rec.num_prefill_tokens else 0)
        elif policy == "simple_chunking":
            assert rec.token_budget == (16 if prefill_only else 0)
        else:  # orca, fastertransformer: no token budget at all
            assert rec.token_budget == 0
        if rec.token_budget:
            assert tokens <= rec.token_budget
