"""Test support for the scheduler tests: a fake worker that replays plan diffs, and a
driver that runs a workload to completion while checking invariants every iteration.

The fake worker keeps its own view of every sequence (tokens, block table, computed
count) built only from the plans, and "samples" a token that depends on the seq id,
the position and the last tokens it knows, so a wrong diff changes the outputs.

It also keeps a fake KV pool: the token written at every slot of every block, kept
after the block is freed (as real KV is). Every computation checks that each earlier
position of the sequence reads the sequence's own token from its block table, so a
prefix-cache hit on the wrong block (or an overwritten shared block) fails loudly.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sarazmq.config import EngineConfig
from sarazmq.options import EngineOptions
from sarazmq.protocol.engine import RequestDelta
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import Request, Scheduler
from sarazmq.sim.run import sim_engine_config

TokenFn = Callable[[int, list[int], int], int]
# called for each plan built: the scheduler, the plan's seq ids, those of each plan still
# in flight before it (oldest first)
PlanHook = Callable[[Scheduler, set[int], list[set[int]]], None]
Requests = list[tuple[str, list[int], SamplingParams]]


def fake_token(seq_id: int, tokens: list[int], num_prompt: int) -> int:
    """Next token after `tokens` (all known tokens of the seq); always in [10, 60)."""
    return (seq_id * 7 + len(tokens) + sum(tokens[-3:])) % 50 + 10


@dataclass
class WorkerSeq:
    tokens: list[int]
    num_prompt: int
    seed: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class FakeWorker:
    """Applies plans exactly as the worker contract says and answers StepResults.
    keep_sampled: append each sampled token to its seq (asynchronous scheduling's worker)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        token_fn: TokenFn = fake_token,
        keep_sampled: bool = False,
    ) -> None:
        self.keep_sampled = keep_sampled
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.token_fn = token_fn
        self.seqs: dict[int, WorkerSeq] = {}
        self.users: dict[int, set[int]] = {}  # block -> live seq ids using it
        self.kv: dict[int, list[int | None]] = {}  # block -> token written at each slot
        self.step = 0

    def _check_context(self, seq: WorkerSeq, seq_id: int, upto: int) -> None:
        """Positions [0, upto) must hold seq's own tokens in its blocks."""
        bs = self.block_size
        for p in range(upto):
            slot = self.kv.get(seq.blocks[p // bs], [None] * bs)[p % bs]
            assert slot == seq.tokens[p], (
                f"seq {seq_id} position {p}: KV holds token {slot}, expected {seq.tokens[p]}"
            )

    def run(self, plan: BatchPlan) -> StepResult:
        assert plan.step == self.step + 1, "plan steps must be consecutive"
        self.step = plan.step
        for sid in plan.freed_seq_ids:
            seq = self.seqs.pop(sid)  # KeyError: freeing a seq the worker does not have
            for b in seq.blocks:
                self.users[b].discard(sid)
                if not self.users[b]:
                    del self.users[b]
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.seqs, f"new seq {ns.seq_id} already exists"
            assert 0 < ns.num_prompt_tokens <= len(ns.token_ids)
            assert ns.num_cached_tokens % self.block_size == 0
            assert 0 <= ns.num_cached_tokens < len(ns.token_ids)
            self.seqs[ns.seq_id] = WorkerSeq(
                list(ns.token_ids), ns.num_prompt_tokens, ns.seed, computed=ns.num_cached_tokens
            )
        seen: set[int] = set()
        seq_ids: list[int] = []
        token_ids: list[int] = []
        for s in plan.scheduled:
            assert s.seq_id not in seen, "a seq scheduled twice in one plan"
            seen.add(s.seq_id)
            seq = self.seqs[s.seq_id]
            seq.tokens.extend(s.append_token_ids)
            for b in s.new_block_ids:
                assert 0 <= b < self.num_blocks, f"block id {b} out of range"
                assert s.seq_id not in self.users.get(b, ()), f"block {b} twice in a table"
                self.users.setdefault(b, set()).add(s.seq_id)
            seq.blocks.extend(s.new_block_ids)
            assert s.num_tokens >= 1
            assert s.start_pos == seq.computed, (
                f"seq {s.seq_id}: start {s.start_pos} != {seq.computed}"
            )
            end = s.start_pos + s.num_tokens
            assert end <= len(seq.tokens), "computing tokens the worker does not know"
            assert len(seq.blocks) * self.block_size >= end, "block table too short"
            # the earlier context must be this seq's own tokens (cached or computed)
            self._check_context(seq, s.seq_id, s.start_pos)
            bs = self.block_size
            for p in range(s.start_pos, end):
                b = seq.blocks[p // bs]
                others = self.users[b] - {s.seq_id}
                assert not others, f"seq {s.seq_id} writes block {b} shared with {others}"
                self.kv.setdefault(b, [None] * bs)[p % bs] = seq.tokens[p]
            seq.computed = end
            assert s.sample == (end == len(seq.tokens)), "sample must mean: reached the end"
            if s.sample:
                seq_ids.append(s.seq_id)
                token_ids.append(self.token_fn(s.seq_id, seq.tokens, seq.num_prompt))
                if self.keep_sampled:
                    seq.tokens.append(token_ids[-1])
        return StepResult(step=plan.step, seq_ids=seq_ids, token_ids=token_ids)


def reference_outputs(
    seq_id: int,
    prompt: list[int],
    params: SamplingParams,
    max_out: int,
    eos: tuple[int, ...],
    token_fn: TokenFn = fake_token,
) -> tuple[list[int], str]:
    """What a request alone would output (the spec's finish rules, re-stated)."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = token_fn(seq_id, tokens, len(prompt))
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and (
            (not params.ignore_eos and t in eos) or t in params.stop_token_ids
        ):
            return out, "stop"
        if len(out) >= max_out:
            return out, "length"


@dataclass
class IterInfo:
    """One iteration as seen from outside, captured right after schedule()."""

    plan: BatchPlan
    decode_seqs: list[int]  # seq ids scheduled as decodes
    prefill_chunks: list[tuple[int, int, int]]  # (seq id, start, num tokens)
    running_decodes_before: list[int]  # seq ids in decode phase before schedule()
    running_prefills_before: list[int]
    num_running_before: int
    num_waiting_before: int
    free_blocks_before: int
    preempted: list[int]  # seq ids that went back to waiting in this schedule()

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.prefill_chunks)

    @property
    def kind(self) -> str:
        if self.decode_seqs and self.prefill_chunks:
            return "mixed"
        return "decode" if self.decode_seqs else "prefill"


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    finish: dict[str, str]
    deltas: list[RequestDelta]
    iters: list[IterInfo]
    requests: dict[str, Request]


def check_blocks(sched: Scheduler) -> None:
    assert all(not r.block_ids for r in sched.waiting), "a waiting request holds blocks"
    ids = [b for r in sched.running for b in r.block_ids]
    held = set(ids)
    assert sched.blocks.num_free_blocks + len(held) == sched.blocks.num_total_blocks, "block leak"
    for r in sched.running:
        assert len(r.block_ids) == len(set(r.block_ids)), "a block twice in one table"
    if not sched.blocks.enable_caching:
        assert len(ids) == len(held), "a block is shared by two requests"
    for b, n in Counter(ids).items():  # a reference per table holding the block
        assert sched.blocks.ref_count(b) == n


def check_worker_view(sched: Scheduler, worker: FakeWorker) -> None:
    """After a plan is applied, the worker's view equals the scheduler's: same live
    seqs, same tokens (the worker may lack only the last sampled token of a decode
    that was not scheduled), same block tables."""
    assert set(worker.seqs) == {r.seq_id for r in sched.running}
    for r in sched.running:
        w = worker.seqs[r.seq_id]
        assert len(w.tokens) == r.num_sent_tokens
        assert r.num_tokens - 1 <= len(w.tokens) <= r.num_tokens
        assert w.tokens == r.all_token_ids[: len(w.tokens)]
        assert w.num_prompt == r.num_prompt_tokens
        assert w.seed == r.seed
        assert w.blocks == r.block_ids


def check_computed(sched: Scheduler, worker: FakeWorker) -> None:
    """After a result is processed, computed counts agree."""
    for r in sched.running:
        assert worker.seqs[r.seq_id].computed == r.num_computed_tokens


def drive(
    sched: Scheduler,
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    *,
    token_fn: TokenFn = fake_token,
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 5000,
    on_iter: Callable[[Scheduler, IterInfo], None] | None = None,
    worker: FakeWorker | None = None,
) -> RunResult:
    """Runs until every request is finished. `arrivals[k]` are added (and `aborts[k]`
    aborted) before the k-th schedule() call. Checks diff and block invariants.
    worker: the fake worker that ran this scheduler's earlier plans (its KV pool holds
    what the prefix cache may hit); a new one by default."""
    aborts = aborts or {}
    if worker is None:
        worker = FakeWorker(sched.block_size, sched.blocks.num_total_blocks, token_fn)
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    all_deltas: list[RequestDelta] = []
    iters: list[IterInfo] = []
    requests: dict[str, Request] = {}
    by_seq: dict[int, Request] = {}
    last_event = max([*arrivals, *aborts], default=0)
    for r in [*sched.waiting, *sched.running]:  # requests added before drive()
        requests[r.request_id] = r
        by_seq[r.seq_id] = r

    def take(deltas: list[RequestDelta]) -> None:
        for d in deltas:
            assert d.request_id not in finish, f"delta after finish for {d.request_id}"
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            assert len(d.token_times) == len(d.new_token_ids)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
        all_deltas.extend(deltas)

    for k in range(max_steps):
        for rid, prompt, params in arrivals.get(k, []):
            sched.add_request(rid, prompt, params)
            req = sched.get_request(rid)
            assert req is not None
            requests[rid] = req
            by_seq[req.seq_id] = req
            outputs.setdefault(rid, [])
        for rid in aborts.get(k, []):
            sched.abort(rid)
        take(sched.drain_finished())
        check_blocks(sched)
        before_dec = [r.seq_id for r in sched.running if not r.is_prefill]
        before_pre = [r.seq_id for r in sched.running if r.is_prefill]
        n_run, n_wait = len(sched.running), len(sched.waiting)
        free_before = sched.blocks.num_free_blocks
        preempt_before = sched.stats().num_preemptions
        plan = sched.schedule()
        check_blocks(sched)
        if plan is None:
            assert not sched.has_unfinished(), "nothing scheduled but work is pending"
            if k >= last_event:
                break
            continue
        info = IterInfo(
            plan=plan,
            decode_seqs=[s.seq_id for s in plan.scheduled if not by_seq[s.seq_id].is_prefill],
            prefill_chunks=[
                (s.seq_id, s.start_pos, s.num_tokens)
                for s in plan.scheduled
                if by_seq[s.seq_id].is_prefill
            ],
            running_decodes_before=before_dec,
            running_prefills_before=before_pre,
            num_running_before=n_run,
            num_waiting_before=n_wait,
            free_blocks_before=free_before,
            preempted=[
                sid for sid in before_dec + before_pre if by_seq[sid].status.value == "waiting"
            ],
        )
        assert sched.stats().num_preemptions - preempt_before == len(info.preempted)
        # decodes first, then prefill chunks (the attention metadata layout)
        kinds = ["d" if s.seq_id in info.decode_seqs else "p" for s in plan.scheduled]
        assert kinds == sorted(kinds), "decodes must precede prefill chunks"
        assert len(plan.scheduled) <= sched.config.max_num_seqs
        iters.append(info)
        if on_iter is not None:
            on_iter(sched, info)
        result = worker.run(plan)
        check_worker_view(sched, worker)
        take(sched.process_result(result))
        check_computed(sched, worker)
        check_blocks(sched)
    else:
        raise AssertionError(f"workload did not finish in {max_steps} steps")
    take(sched.drain_finished())
    assert not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == sched.blocks.num_total_blocks
    return RunResult(outputs, finish, all_deltas, iters, requests)


def drive_inflight(
    sched: Scheduler,
    requests: Requests,
    *,
    keep_sampled: bool = False,
    abort_at: int = -1,
    on_plan: PlanHook | None = None,
    max_steps: int = 5000,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Runs every request to its end with as many plans in flight as the scheduler takes
    (pipeline micro-batches, asynchronous scheduling), a fake worker applying the plans
    in order (`keep_sampled`: it appends its own sampled tokens, as under asynchronous
    scheduling). Aborts the first request at step `abort_at`. Checks every step: at most
    max_inflight plans in flight, schedule() refused when full, no delta after a finish,
    the block pool consistent. Returns each request's outputs and finish reason."""
    worker = FakeWorker(sched.block_size, sched.blocks.num_total_blocks, keep_sampled=keep_sampled)
    for rid, prompt, params in requests:
        sched.add_request(rid, prompt, params)
    inflight: deque[tuple[StepResult, set[int]]] = deque()
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finish: dict[str, str] = {}
    for step in range(1, max_steps + 1):
        if not (sched.has_unfinished() or inflight):
            break
        if step == abort_at:
            sched.abort(requests[0][0])
        while sched.can_schedule():
            plan = sched.schedule()
            if plan is None:
                break
            seqs = {s.seq_id for s in plan.scheduled}
            if on_plan is not None:
                on_plan(sched, seqs, [earlier for _, earlier in inflight])
            inflight.append((worker.run(plan), seqs))
            assert sched.num_inflight == len(inflight) <= sched.max_inflight
        assert inflight, "nothing in flight and nothing scheduled, with work pending"
        if not sched.can_schedule():
            try:
                sched.schedule()
            except RuntimeError as e:
                assert "plans in flight" in str(e)
            else:
                raise AssertionError("schedule() with every slot in flight did not raise")
        result, _ = inflight.popleft()
        for d in sched.drain_finished() + sched.process_result(result):
            assert d.request_id not in finish, f"delta after the finish of {d.request_id}"
            outputs[d.request_id].extend(d.new_token_ids)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
        check_blocks(sched)
    else:
        raise AssertionError(f"workload did not finish in {max_steps} steps")
    assert sched.blocks.num_free_blocks == sched.blocks.num_total_blocks
    return outputs, finish


def sim_config(*, num_blocks: int, max_model_len: int, **options: object) -> EngineConfig:
    """A simulated engine's resolved config from engine options (`EngineOptions` fields),
    as the simulating commands build it."""
    return sim_engine_config(
        EngineOptions(**options),  # type: ignore[arg-type]
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )
