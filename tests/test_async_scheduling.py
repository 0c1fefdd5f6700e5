"""Asynchronous scheduling: plan N+1 built while plan N runs, a request in both.

The scheduler-level tests run a fake worker that keeps its own sampled tokens (as the
real runner does with keep_sampled_tokens) and check every request's outputs against
what it would output alone; the engine test checks that the real model's outputs do not
change (float32: the batches differ, one plan later or earlier, which moves float32 sums
by ~1e-6, far from flipping a token here; in bf16 it would flip near-ties).
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from scheduler_harness import FakeWorker, Requests, drive_inflight, reference_outputs

from sarazmq import LLM, SamplingParams
from sarazmq.config import POLICIES, EngineConfig, SchedulerConfig
from sarazmq.options import EngineOptions
from sarazmq.protocol.worker import StepResult
from sarazmq.scheduler import Scheduler
from sarazmq.scheduler.build import build_scheduler


def _drive(
    sched: Scheduler, requests: Requests, abort_at: int = -1
) -> tuple[dict[str, list[int]], dict[str, str], dict[str, int]]:
    """`drive_inflight` with a worker keeping its own tokens. Also returns counters:
    `shared` plans that held a request also in the plan before them (still in flight),
    `pending_preempted` plans built while a preempted request waited for the token its
    plan in flight samples."""
    counts = {"shared": 0, "pending_preempted": 0}

    def on_plan(sched: Scheduler, seqs: set[int], earlier: list[set[int]]) -> None:
        assert len(earlier) < 2
        if earlier and seqs & earlier[-1]:
            counts["shared"] += 1
        if any(r.num_pending_samples for r in sched.waiting):
            counts["pending_preempted"] += 1

    outputs, finish = drive_inflight(
        sched, requests, keep_sampled=True, abort_at=abort_at, on_plan=on_plan
    )
    return outputs, finish, counts


def _requests(n: int, seed: int, eos_stops: bool = False) -> Requests:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 100) for _ in range(8)]
    return [
        (
            f"r{i}",
            (shared if i % 2 else [])
            + [rng.randrange(1, 100) for _ in range(rng.randrange(2, 30))],
            SamplingParams(
                temperature=0,
                max_tokens=rng.randrange(1, 14),
                ignore_eos=not eos_stops,
                min_tokens=2 if eos_stops and i % 3 == 0 else 0,
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_each_request_gets_its_own_outputs_under_every_policy(policy: str) -> None:
    """Two plans in flight with a request in both, a small pool (preemptions of requests
    whose token is still being sampled), the prefix cache on, and stops on an EOS id the
    fake model emits: every request's outputs are what it would output alone."""
    eos = (17, 23, 41)
    requests = _requests(14, seed=3, eos_stops=True)
    cfg = SchedulerConfig(policy=policy, chunk_size=16, max_num_seqs=6)
    sched = Scheduler(cfg, 4, 36, 128, eos, enable_prefix_caching=True, async_scheduling=True)
    outputs, finish, counts = _drive(sched, requests)
    assert counts["shared"] > 0  # plans really went on from plans still in flight
    stops = 0
    for seq_id, (rid, prompt, params) in enumerate(requests):
        expect, reason = reference_outputs(seq_id, prompt, params, params.max_tokens, eos)
        assert (outputs[rid], finish[rid]) == (expect, reason), rid
        stops += reason == "stop"
    assert stops > 0  # the finish a plan in flight cannot foresee happened
    stats = sched.stats()
    assert stats.async_scheduling and stats.num_overlapped_plans >= counts["shared"]


def test_a_preempted_request_waits_for_the_token_in_flight() -> None:
    """A decode needing a block preempts the newest request, itself in the plan in
    flight: it goes back to waiting with that plan's token pending, is not readmitted
    before the token is in, and still outputs what it would alone."""
    requests = [
        (f"r{i}", [i + 1] * 7, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for i in range(4)
    ]
    cfg = SchedulerConfig(policy="vllm", chunk_size=64, max_num_seqs=4)
    sched = Scheduler(cfg, 4, 12, 64, (), async_scheduling=True)
    outputs, finish, counts = _drive(sched, requests)
    assert counts["pending_preempted"] > 0
    assert sched.stats().num_preemptions > 0
    for seq_id, (rid, prompt, params) in enumerate(requests):
        expect, _ = reference_outputs(seq_id, prompt, params, params.max_tokens, ())
        assert outputs[rid] == expect and finish[rid] == "length", rid


def test_the_next_plan_decodes_from_the_token_in_flight() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=16), 4, 16, 64, (), async_scheduling=True)
    sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    first = sched.schedule()
    assert first is not None and first.scheduled[0].sample  # the whole prompt, sampling
    second = sched.schedule()  # built before the first result is in
    assert second is not None and sched.num_inflight == 2 and not sched.can_schedule()
    (s,) = second.scheduled
    # the position of the token the first plan samples, which the worker feeds itself
    assert (s.start_pos, s.num_tokens, s.append_token_ids, s.sample) == (5, 1, [], True)
    req = sched.get_request("a")
    assert req is not None and req.num_pending_samples == 2 and req.num_output_tokens == 0
    worker = FakeWorker(4, 16, keep_sampled=True)
    r1, r2 = worker.run(first), worker.run(second)
    assert [d.new_token_ids for d in sched.process_result(r1)] == [r1.token_ids]
    # the third (last) token is sampled by a plan built now; none after it
    third = sched.schedule()
    assert third is not None and not sched.can_schedule()
    sched.process_result(r2)
    assert sched.schedule() is None  # its last token is pending: nothing to run
    (last,) = sched.process_result(worker.run(third))
    assert last.finish_reason == "length" and not sched.has_unfinished()


def test_a_request_at_its_length_is_not_scheduled_again() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=16), 4, 16, 64, (), async_scheduling=True)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    assert sched.schedule() is not None
    assert sched.schedule() is None  # its one token is the plan in flight's


def test_abort_with_two_plans_in_flight() -> None:
    requests = [
        (f"r{i}", [i + 1] * (5 + i), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for i in range(5)
    ]
    sched = Scheduler(
        SchedulerConfig(chunk_size=8, max_num_seqs=5), 4, 40, 128, (), async_scheduling=True
    )
    outputs, finish, _ = _drive(sched, requests, abort_at=4)
    assert finish["r0"] == "abort"
    for seq_id, (rid, prompt, params) in enumerate(requests[1:], start=1):
        expect, _ = reference_outputs(seq_id, prompt, params, params.max_tokens, ())
        assert outputs[rid] == expect and finish[rid] == "length"


def test_iterations_are_timed_from_the_previous_result() -> None:
    """With a plan built while another runs, an iteration's record starts when the
    worker could start it (the previous result), so records do not overlap."""
    now = [0.0]
    sched = Scheduler(
        SchedulerConfig(chunk_size=16), 4, 32, 64, (), clock=lambda: now[0], async_scheduling=True
    )
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    worker = FakeWorker(4, 32, keep_sampled=True)
    pending: deque[StepResult] = deque()
    while sched.has_unfinished() or pending:
        while sched.can_schedule() and (plan := sched.schedule()) is not None:
            pending.append(worker.run(plan))
        now[0] += 1.0
        sched.process_result(pending.popleft())
    records = list(sched.iteration_records)
    assert len(records) >= 5
    for prev, rec in zip(records, records[1:]):
        assert rec.start >= prev.end and rec.end - rec.start == 1.0


def test_async_scheduling_needs_one_worker_and_co_located_instances() -> None:
    for bad in (
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"prefill_instances": 1, "decode_instances": 1},
    ):
        with pytest.raises(ValueError, match="async_scheduling needs one worker"):
            EngineConfig(async_scheduling=True, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="async_scheduling needs one pipeline stage"):
        Scheduler(SchedulerConfig(), 4, 8, 64, (), max_inflight=2, async_scheduling=True)
    # replicas are instances of one worker each: allowed
    config = EngineOptions(
        async_scheduling=True, data_parallel_size=2, max_model_len=64
    ).to_config()
    sched = build_scheduler(config, num_blocks=8)
    assert sched.async_scheduling and sched.max_inflight == 2


def test_cli_flag_sets_the_config() -> None:
    from click.testing import CliRunner

    from sarazmq.cli import main

    result = CliRunner().invoke(main, ["serve", "--async-scheduling", "--tp", "2", "--help"])
    assert result.exit_code == 0 and "--async-scheduling" in result.output
    bad = CliRunner().invoke(main, ["serve", "--async-scheduling", "--pp", "2"])
    assert bad.exit_code != 0
    lines = [line for line in bad.output.strip().splitlines() if line]
    assert len(lines) == 1 and "async_scheduling needs one worker" in lines[0]


@pytest.mark.model
def test_the_real_model_outputs_do_not_change() -> None:
    """The default model in float32: greedy, seeded sampling with logprobs, stop strings,
    the prefix cache and preemptions (a pool of 14 blocks for 12 requests) give the same
    outputs with and without asynchronous scheduling."""
    shared = "You are a storyteller. Your tales are short, kind and full of castles. " * 2
    prompts = [shared + f"Tell me about dragon number {i}. " * (i % 5 + 1) for i in range(12)]
    params = [
        SamplingParams(
            max_tokens=8 + 3 * i,
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            logprobs=2 if i % 3 == 0 else None,
            stop=["dragon"] if i % 4 == 1 else [],
        )
        for i in range(12)
    ]
    got = {}
    logprobs = {}
    for on in (False, True):
        llm = LLM(
            async_scheduling=on,
            dtype="float32",
            gguf_matmul="float",
            chunk_size=32,
            block_size=16,
            num_kv_blocks=14,
            enable_prefix_caching=True,
        )
        outs = llm.generate(prompts, params)
        got[on] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
        logprobs[on] = [[lp.logprob for lp in o.logprobs if lp] for o in outs]
        stats = llm.engine.scheduler.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert (stats.num_overlapped_plans > 0) == on
        # in process the forward runs inside step(): each record spans its own forward
        records = list(llm.engine.scheduler.iteration_records)
        assert records and all(r.forward_s > 0 for r in records)
        bad = [
            (on, r.step, r.end - r.start, r.forward_s)
            for r in records
            if r.end - r.start < r.forward_s
        ]
        assert not bad, bad[:5]
    assert got[True] == got[False]
    assert {reason for _, _, reason in got[True]} >= {"stop", "length"}
    for i in range(0, 12, 3):  # the requests that asked for logprobs
        assert len(logprobs[True][i]) == len(got[True][i][0])
        assert logprobs[True][i] == pytest.approx(logprobs[False][i], abs=1e-4)


def test_a_request_in_both_plans_stays_held_until_the_second_result() -> None:
    from typing import Any, cast

    from sarazmq.scheduler.inflight import InflightPlan, InflightQueue

    def entry(*seq_ids: int) -> InflightPlan:
        none = cast(Any, None)
        reqs = {sid: none for sid in seq_ids}
        return InflightPlan(none, reqs, 0.0, 0, none, none)

    queue = InflightQueue(max_inflight=2)
    queue.push(entry(1, 2))
    queue.push(entry(2, 3))
    assert queue.seq_ids == {1, 2, 3}
    queue.pop()
    assert queue.seq_ids == {2, 3}  # seq 2 is still in the second plan
    queue.pop()
    assert queue.seq_ids == set()
