"""The scheduler's roles in a disaggregated deployment (sarazmq.scheduler.transfers):
a prefill instance parks a request after its first token with its blocks and frees them
on release; a decode instance gives an arrived request blocks, pulls its KV, and only then
lets it run; aborts and failed pulls leak nothing."""

from __future__ import annotations

from sarazmq.config import SchedulerConfig
from sarazmq.protocol.worker import StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.request import RequestStatus
from sarazmq.scheduler.scheduler import Scheduler
from sarazmq.scheduler.transfers import KVSource

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _sched(role: str, world: int = 1, blocks: int = 32) -> Scheduler:
    cfg = SchedulerConfig(chunk_size=64, max_model_len=256, watermark=0.0)
    return Scheduler(cfg, 4, blocks, 256, (), role=role, world_size=world)


def _step(sched: Scheduler, token: int = 9):
    plan = sched.schedule()
    assert plan is not None
    sampled = [s.seq_id for s in plan.scheduled if s.sample]
    deltas = sched.process_result(
        StepResult(step=plan.step, seq_ids=sampled, token_ids=[token] * len(sampled))
    )
    return plan, deltas


def test_a_prefill_instance_parks_after_the_first_token_and_releases() -> None:
    sched = _sched("prefill")
    free0 = sched.blocks.num_free_blocks
    sched.add_request("a", list(range(10, 20)), PARAMS)  # 10 tokens: 3 blocks of 4
    sched.add_request("one", list(range(10, 14)), SamplingParams(max_tokens=1))
    _, deltas = _step(sched, token=7)
    # both streamed their first token; "one" is done, "a" goes on elsewhere
    assert {d.request_id: d.finish_reason for d in deltas} == {"a": "", "one": "length"}
    (parked,) = sched.take_handoffs()
    assert parked.request_id == "a" and parked.status is RequestStatus.PARKED
    assert parked.output_token_ids == [7] and len(parked.block_ids) == 3
    assert sched.running == [] and not sched.has_unfinished()
    assert sched.take_handoffs() == []
    # its blocks stay taken (a decode instance reads them) until released
    assert sched.blocks.num_free_blocks == free0 - 3
    plan = sched.schedule()
    assert plan is None  # nothing to run: the parked request is not scheduled again
    assert sched.release_parked("a") and not sched.release_parked("a")
    assert sched.blocks.num_free_blocks == free0
    # an abort of a parked request frees it too (its client went away)
    sched.add_request("b", list(range(30, 40)), PARAMS)
    _step(sched)
    sched.take_handoffs()
    assert sched.abort("b") and sched.blocks.num_free_blocks == free0


def test_a_decode_instance_pulls_before_it_runs() -> None:
    sched = _sched("decode", world=2)
    free0 = sched.blocks.num_free_blocks
    src = KVSource(instance=0, request_id="p/a", block_ids=[5, 6, 7])
    sched.add_prefilled_request(
        "a", list(range(10, 20)), PARAMS, first_token=7, first_token_time=1.0,
        first_scheduled_time=0.5, arrival_time=0.2, source=src,
    )  # fmt: skip
    assert sched.schedule() is None  # not runnable before its KV is here
    (pull,) = sched.start_pulls()
    assert pull.source_block_ids == [5, 6, 7] and pull.source_request_id == "p/a"
    # prompt + first token = 11 tokens: 3 blocks, the prompt's KV into all three
    assert len(pull.block_ids) == 3 and sched.blocks.num_free_blocks == free0 - 3
    assert sched.start_pulls() == []
    assert sched.kv_pulled(pull.seq_id, 0, "") is None  # rank 1 still pulling
    assert sched.kv_pulled(pull.seq_id, 0, "") is None  # a repeated report changes nothing
    req, source, err = sched.kv_pulled(pull.seq_id, 1, "")  # type: ignore[misc]
    assert req.request_id == "a" and source == src and err == ""
    plan, deltas = _step(sched, token=8)
    (new,) = plan.new_seqs
    assert new.num_cached_tokens == 10 and new.token_ids == [*range(10, 20), 7]
    assert [(s.num_tokens, s.new_block_ids) for s in plan.scheduled] == [(1, pull.block_ids)]
    assert deltas[0].new_token_ids == [8]
    assert sched.blocks.num_free_blocks == free0 - 3  # no second allocation


def test_transfers_that_fail_or_are_aborted_leak_nothing() -> None:
    sched = _sched("decode", world=1, blocks=8)
    free0 = sched.blocks.num_free_blocks

    def arrive(rid: str, n: int) -> None:
        sched.add_prefilled_request(
            rid, list(range(10, 10 + n)), PARAMS, first_token=7, first_token_time=1.0,
            first_scheduled_time=0.5, arrival_time=0.2,
            source=KVSource(0, "p/" + rid, list(range((n + 3) // 4))),
        )  # fmt: skip

    arrive("fails", 10)
    arrive("aborted", 10)
    arrive("queued", 20)  # 6 blocks: waits (only 8 in all)
    pulls = sched.start_pulls()
    assert [p.seq_id for p in pulls] == [0, 1] and sched.blocks.num_free_blocks == free0 - 6
    # a failed pull finishes its request with an error and frees its blocks
    req, _, err = sched.kv_pulled(0, 0, "no reply from the source")  # type: ignore[misc]
    assert err == "rank 0: no reply from the source" and req.finish_reason == "error"
    assert sched.get_request("fails") is None
    # aborted while pulling: finished now, its blocks kept until the pull reports
    assert sched.abort("aborted")
    assert sched.blocks.num_free_blocks == free0 - 3
    _, _, err = sched.kv_pulled(1, 0, "")  # type: ignore[misc]
    assert err == "cancelled" and sched.blocks.num_free_blocks == free0
    # aborted while queued for blocks: gone at once
    assert sched.abort("queued") and len(sched.pulls) == 0
    assert sched.blocks.num_free_blocks == free0 and not sched.has_unfinished()
    assert sched.kv_pulled(99, 0, "") is None  # a report for no pull
