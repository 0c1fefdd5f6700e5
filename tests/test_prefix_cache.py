"""Automatic prefix caching: keys, hits, reference counts, eviction order, the scheduler's
use of it under every policy, the reset control request, and (marked `model`) greedy
outputs with caching on equal to caching off on the real model.

The scheduler tests run through `scheduler_harness.drive`, whose fake worker keeps a
fake KV pool (the token written at every slot, kept after a block is freed) and checks
at every computation that each earlier position of the sequence holds the sequence's
own token: a hit on the wrong block, or a write into a shared block, fails there.
"""

from __future__ import annotations

import pytest
from scheduler_harness import FakeWorker, drive

from sarazmq.config import POLICIES, SchedulerConfig
from sarazmq.protocol.engine import ResetPrefixCache, StatsAnswer
from sarazmq.protocol.worker import BatchPlan, NewSeq
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import BlockAllocationError, BlockManager, Request, Scheduler
from sarazmq.scheduler.prefix_cache import ROOT_KEY, sha256_block_key
from sarazmq.scheduler.service import SchedulerActions, SchedulerService

BS = 4


def req(tokens: list[int], rid: str = "r", salt: str | None = None) -> Request:
    return Request(rid, 0, list(tokens), SamplingParams(cache_salt=salt), 0, 16, 0.0)


def computed(bm: BlockManager, r: Request, upto: int | None = None) -> Request:
    """Admits r (with whatever hits it has), marks its KV computed and keys its blocks."""
    hits = bm.find_cached_blocks(r)
    bm.allocate_with_hits(r, hits, r.num_tokens)
    r.num_computed_tokens = r.num_tokens if upto is None else upto
    bm.cache_full_blocks(r)
    return r


def state(bm: BlockManager) -> tuple:
    return (
        list(bm._free),
        list(bm._evictable),
        list(bm._ref),
        list(bm._gen),
        dict(bm._by_key),
        [None if c is None else (c.key, c.parent, c.token_ids, c.salt) for c in bm._cached],
        bm.num_evictions,
    )


def greedy(max_tokens: int = 6, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def make(
    policy: str = "sarathi",
    *,
    caching: bool = True,
    chunk_size: int = 16,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    watermark: float = 0.0,
    hash_fn=sha256_block_key,
) -> Scheduler:
    cfg = SchedulerConfig(
        policy=policy, chunk_size=chunk_size, max_num_seqs=max_num_seqs, watermark=watermark
    )
    return Scheduler(
        cfg,
        block_size=BS,
        num_blocks=num_blocks,
        max_model_len=256,
        eos_token_ids=(2,),
        seed=0,
        enable_prefix_caching=caching,
        block_hash_fn=hash_fn,
    )


# ------------------------------------------------------------------------------ keys


def test_keys_chain_equal_prefixes_and_one_changed_token_changes_every_later_key() -> None:
    bm = BlockManager(BS, 16, enable_caching=True)
    a = list(range(100, 116))
    b = list(a)
    b[5] = 999  # in block 1
    ka = bm.block_keys(req(a), 4)
    kb = bm.block_keys(req(b), 4)
    assert ka == bm.block_keys(req(list(a)), 4)  # deterministic, equal prefixes equal keys
    assert ka[0] == kb[0]
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))
    assert len(set(ka)) == 4 and all(len(k) == 32 for k in ka)
    # the chain: key i = SHA-256(key i-1 || block i's tokens, salt)
    assert ka[0] == sha256_block_key(ROOT_KEY, a[:4], None)
    assert ka[1] == sha256_block_key(ka[0], a[4:8], None)
    # the same tokens under another parent hash differently
    assert sha256_block_key(ka[0], a[:4], None) != ka[0]


def test_salt_is_part_of_every_key_and_never_hits_across() -> None:
    bm = BlockManager(BS, 16, enable_caching=True)
    toks = list(range(100, 113))
    computed(bm, req(toks, "a", salt="tenant-1"))
    assert bm.find_cached_blocks(req(toks, "b", salt="tenant-2")) == []
    assert bm.find_cached_blocks(req(toks, "c")) == []
    assert len(bm.find_cached_blocks(req(toks, "d", salt="tenant-1"))) == 3
    k1 = bm.block_keys(req(toks, salt="x"), 1)[0]
    assert k1 != bm.block_keys(req(toks, salt="y"), 1)[0] != bm.block_keys(req(toks), 1)[0]


def test_cache_salt_validated() -> None:
    from sarazmq.validation import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 5000)


# ------------------------------------------------------------------------------ hits


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(BS, 16, enable_caching=True)
    r = computed(bm, req(list(range(100, 110))), upto=6)  # 10 tokens, 6 computed
    assert [bm.key_of(b) is not None for b in r.block_ids] == [True, False, False]
    r.num_computed_tokens = 10
    bm.cache_full_blocks(r)
    assert [bm.key_of(b) is not None for b in r.block_ids] == [True, True, False]
    assert bm.num_cached_blocks == 2


@pytest.mark.parametrize(
    ("n_cached_src", "query_len", "expect_blocks"),
    [
        (16, 16, 3),  # fully cached, block-aligned prompt: the last block is recomputed
        (16, 17, 4),  # one token beyond: every full block hits
        (16, 13, 3),
        (16, 12, 2),  # <= length - 1 tokens
        (16, 4, 0),
        (16, 1, 0),
        (8, 16, 2),  # the source only cached 2 blocks
    ],
)
def test_hits_contiguous_from_block_0_block_aligned_at_most_len_minus_1(
    n_cached_src: int, query_len: int, expect_blocks: int
) -> None:
    bm = BlockManager(BS, 32, enable_caching=True)
    src = computed(bm, req(list(range(100, 100 + n_cached_src)), "src"))
    q = req(list(range(100, 100 + query_len)) + [7] * max(0, query_len - n_cached_src), "q")
    q.prompt_token_ids = q.prompt_token_ids[:query_len]
    hits = bm.find_cached_blocks(q)
    assert hits == src.block_ids[:expect_blocks]
    assert len(hits) * BS <= query_len - 1


def test_hits_stop_at_the_first_missing_block() -> None:
    bm = BlockManager(BS, 32, enable_caching=True)
    toks = list(range(100, 117))
    src = computed(bm, req(toks, "src"))
    # evict block 1 only (as if): drop its key
    bm._drop_key(src.block_ids[1])
    assert bm.find_cached_blocks(req(toks, "q")) == src.block_ids[:1]


def test_generated_tokens_blocks_are_reusable() -> None:
    bm = BlockManager(BS, 32, enable_caching=True)
    r = req(list(range(100, 106)))
    bm.allocate_with_hits(r, [], 6)
    r.num_computed_tokens = 6
    r.output_token_ids.extend([50, 51, 52])  # decoding: outputs become KV one at a time
    bm.allocate(r, 9)
    r.num_computed_tokens = 8
    bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 2  # block 1 holds prompt 4,5 and outputs 50, 51
    follow_up = req([*range(100, 106), 50, 51, 52, 9])
    assert bm.find_cached_blocks(follow_up) == r.block_ids[:2]


# ------------------------------------------------------------------------------ refcounts


def test_reference_counts_on_sharing_and_freeing() -> None:
    bm = BlockManager(BS, 16, enable_caching=True)
    toks = list(range(100, 113))
    a = computed(bm, req(toks, "a"))
    b = computed(bm, req(toks, "b"))
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [bm.ref_count(x) for x in a.block_ids] == [2, 2, 2, 1]
    assert bm.num_free_blocks == 16 - 5
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_ids] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 16 - 4
    assert bm.evictable_order() == []  # still in use by b
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3
    with pytest.raises(BlockAllocationError, match="double free"):
        b.block_ids = [0]
        bm.free(b)


# ------------------------------------------------------------------------------ eviction


def test_eviction_order_unkeyed_first_then_lru_tail_before_head() -> None:
    bm = BlockManager(BS, 10, enable_caching=True)
    a = computed(bm, req(list(range(100, 109)), "a"))  # blocks 0,1 keyed, 2 partial
    b = computed(bm, req(list(range(200, 209)), "b"))  # blocks 3,4 keyed, 5 partial
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    # keyed: a's tail before a's head, then b's tail before its head
    assert bm.evictable_order() == [1, 0, 4, 3]
    # unkeyed blocks (never used 6..9, then the partial blocks) go before any keyed one
    c = req(list(range(300, 324)), "c")  # 6 blocks, no hits
    bm.allocate_with_hits(c, [], 24)
    assert c.block_ids == [6, 7, 8, 9, 2, 5]
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 4
    d = req(list(range(400, 407)), "d")
    bm.allocate_with_hits(d, [], 7)
    assert d.block_ids == [1, 0] and bm.num_evictions == 2
    assert bm.evictable_order() == [4, 3]


def test_hit_refreshes_recency() -> None:
    bm = BlockManager(BS, 6, enable_caching=True)
    a = computed(bm, req(list(range(100, 105)), "a"))  # block 0 keyed
    b = computed(bm, req(list(range(200, 205)), "b"))  # block 2 keyed
    bm.free(a)
    bm.free(b)
    assert bm.evictable_order() == [0, 2]
    a2 = computed(bm, req(list(range(100, 105)), "a2"))  # hits block 0 again
    assert a2.block_ids[0] == 0
    bm.free(a2)
    assert bm.evictable_order() == [2, 0]  # b's block is now the least recently used


def test_block_in_use_is_never_evicted() -> None:
    bm = BlockManager(BS, 4, enable_caching=True)
    a = computed(bm, req(list(range(100, 109)), "a"))  # 3 blocks in use, 2 keyed
    c = req(list(range(300, 303)), "c")
    bm.allocate_with_hits(c, [], 3)  # the one free block
    with pytest.raises(BlockAllocationError):
        bm.allocate(c, 8)
    assert all(bm.key_of(b) is not None for b in a.block_ids[:2])


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(BS, 8, enable_caching=True)
    toks = list(range(100, 117))
    a = computed(bm, req(toks, "a"))  # 5 blocks, 4 keyed
    bm.free(a)
    other = computed(bm, req(list(range(500, 509)), "o"))  # 3 blocks: leaves 5 free
    big = req(toks + list(range(900, 920)), "big")  # 37 tokens: 10 blocks, 4 hits
    hits = bm.find_cached_blocks(big)
    assert len(hits) == 4
    assert not bm.can_allocate_with_hits(big.num_tokens, hits)
    before = state(bm)
    with pytest.raises(BlockAllocationError):
        bm.allocate_with_hits(big, hits, big.num_tokens)
    assert state(bm) == before and big.block_ids == []
    grow = req(list(range(700, 703)), "g")
    with pytest.raises(BlockAllocationError):
        bm.allocate(grow, 4 * 9)
    assert state(bm) == before and grow.block_ids == []
    assert other.block_ids


def test_recycled_block_loses_its_old_key() -> None:
    bm = BlockManager(BS, 2, enable_caching=True)
    toks = list(range(100, 105))
    a = computed(bm, req(toks, "a"))
    old_key = bm.key_of(a.block_ids[0])
    bm.free(a)
    b = computed(bm, req(list(range(200, 208)), "b"))  # needs both blocks: evicts
    assert bm.num_evictions == 1
    assert old_key is not None and old_key not in bm._by_key
    assert bm.key_of(b.block_ids[0]) != old_key
    bm.free(b)
    assert bm.find_cached_blocks(req(toks, "again")) == []


def test_recycled_parent_invalidates_its_cached_children() -> None:
    """A parent evicted and refilled with the same tokens does not make its old child's
    KV reachable through it (the child was computed after the old parent)."""
    bm = BlockManager(BS, 8, enable_caching=True)
    toks = list(range(100, 109))
    a = computed(bm, req(toks, "a"))
    p, child = a.block_ids[0], a.block_ids[1]
    bm.free(a)
    bm._drop_key(p)  # as if only the parent had been evicted and handed out again
    bm._gen[p] += 1
    bm._free.appendleft(bm._evictable.pop(p) or p)
    again = computed(bm, req(toks[:5], "again"))  # recomputes block 0 somewhere
    assert bm.key_of(child) is not None
    assert bm.find_cached_blocks(req(toks, "q")) == again.block_ids[:1]


def test_duplicate_copies_stay_unkeyed_and_the_chain_continues_from_the_keyed_one() -> None:
    bm = BlockManager(BS, 16, enable_caching=True)
    a = req(list(range(100, 109)), "a")
    b = req([*range(100, 108), 7, 7, 7, 7, 7], "b")  # same first 2 blocks, then its own
    bm.allocate_with_hits(a, bm.find_cached_blocks(a), 9)  # both cold: computed twice
    bm.allocate_with_hits(b, bm.find_cached_blocks(b), 13)
    a.num_computed_tokens, b.num_computed_tokens = 9, 13
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert [bm.key_of(x) is not None for x in b.block_ids] == [False, False, True, False]
    c = req([*b.prompt_token_ids, 1], "c")
    assert bm.find_cached_blocks(c) == [*a.block_ids[:2], b.block_ids[2]]


def test_reset_cache_refused_while_in_use() -> None:
    bm = BlockManager(BS, 8, enable_caching=True)
    a = computed(bm, req(list(range(100, 109)), "a"))
    ok, why = bm.reset_cache()
    assert not ok and "in use" in why
    bm.free(a)
    assert bm.reset_cache() == (True, "")
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 and not bm.evictable_order()
    assert bm.find_cached_blocks(req(list(range(100, 109)), "b")) == []


# ------------------------------------------------------------------------------ collisions


def colliding(parent: bytes, tokens: object, salt: object) -> bytes:
    return b"\0" * 32


def test_colliding_hash_never_gives_a_wrong_hit() -> None:
    bm = BlockManager(BS, 32, enable_caching=True, hash_fn=colliding)
    a = computed(bm, req(list(range(100, 117)), "a"))
    assert bm.num_cached_blocks == 1  # one key for everything: only a's block 0 holds it
    assert bm.find_cached_blocks(req(list(range(200, 217)), "b")) == []
    # block 1 maps to a's block 0 through the colliding key: its parent check refuses it
    assert bm.find_cached_blocks(req(list(range(100, 117)), "c")) == a.block_ids[:1]


@pytest.mark.parametrize("policy", POLICIES)
def test_colliding_hash_under_load_gives_the_same_outputs(policy: str) -> None:
    """Shared and near-shared prefixes, a tiny pool (evictions and preemptions) and a hash
    that always collides: the fake worker's KV check passes and outputs equal caching
    off."""
    arrivals = shared_prefix_workload()
    off = drive(make(policy, caching=False, num_blocks=24), arrivals)
    on = drive(make(policy, num_blocks=24, hash_fn=colliding), arrivals)
    assert on.outputs == off.outputs and on.finish == off.finish


# ------------------------------------------------------------------------------ scheduler


def shared_prefix_workload(n: int = 10) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    system = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
    out: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i in range(n):
        tail = [300 + i] * (i % 4 + 1)
        prompt = system + tail if i % 3 else system[:9] + [400 + i] + system[9:] + tail
        out.setdefault(i * 3, []).append((f"r{i}", prompt, greedy(6 + i % 3, ignore_eos=True)))
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk_size", [3, 8, 64])
def test_every_policy_same_outputs_with_caching_and_hits(policy: str, chunk_size: int) -> None:
    arrivals = shared_prefix_workload()
    off_sched = make(policy, caching=False, chunk_size=chunk_size)
    off = drive(off_sched, arrivals)
    sched = make(policy, chunk_size=chunk_size)
    on = drive(sched, arrivals)
    assert on.outputs == off.outputs and on.finish == off.finish
    st = sched.stats()
    assert st.prefix_cache_hits > 0 and st.prefix_caching
    assert st.prefix_cache_queries == off_sched.stats().prefix_cache_queries
    assert off_sched.stats().prefix_cache_hits == 0
    # only the uncached tokens are computed (fewer prefill tokens in total)
    pre_on = sum(i.num_prefill_tokens for i in on.iters)
    pre_off = sum(i.num_prefill_tokens for i in off.iters)
    assert pre_on == pre_off - st.prefix_cache_hits - st.prefix_cache_preempted_hits
    assert not off.deltas or all(d.num_prompt_tokens for d in on.deltas)


def test_cached_tokens_do_not_count_against_the_budget() -> None:
    sched = make("sarathi", chunk_size=8)
    w = FakeWorker(BS, 64)
    prompt = list(range(100, 133))  # 33 tokens
    drive(sched, {0: [("a", prompt, greedy(2))]}, worker=w)
    res = drive(sched, {0: [("b", prompt, greedy(2))]}, worker=w)
    # b starts at 32 (8 cached blocks) and computes its one token in one iteration
    assert res.iters[0].prefill_chunks == [(res.requests["b"].seq_id, 32, 1)]
    assert res.iters[0].plan.new_seqs[0].num_cached_tokens == 32
    # its first plan entry brings the whole table, the shared blocks first
    first = res.iters[0].plan.scheduled[0]
    assert len(first.new_block_ids) == 9
    # vllm: a whole prompt longer than the budget is admitted when its uncached part fits
    v = make("vllm", chunk_size=8)
    v.policy.max_model_len = 8  # budget max(chunk_size, max_model_len) = 8
    w = FakeWorker(BS, 64)
    drive(v, {0: [("a", prompt[:8], greedy(1))]}, worker=w)
    res = drive(v, {0: [("b", [*prompt[:8], 5, 6, 7], greedy(1))]}, worker=w)
    assert res.iters[0].prefill_chunks[0][1:] == (8, 3)


def test_watermark_counts_only_uncached_blocks() -> None:
    sched = make("sarathi", chunk_size=64, num_blocks=20, watermark=0.25)  # 5 blocks kept
    w = FakeWorker(BS, 20)
    prompt = list(range(100, 149))  # 49 tokens: 13 blocks, 12 cached after this
    drive(sched, {0: [("a", prompt, greedy(1))]}, worker=w)
    # b shares the 12 cached blocks, which are in use by a running copy of the prompt
    sched.add_request("a2", prompt, greedy(30, ignore_eos=True))
    plan = sched.schedule()
    assert plan is not None and plan.new_seqs[0].num_cached_tokens == 48
    sched.process_result(w.run(plan))
    assert sched.blocks.num_free_blocks == 20 - 13
    # 7 free: a cold 49-token prompt (13 blocks) cannot come in, nor a prompt of 3
    # blocks + watermark 5; the shared prompt needs only its 1 uncached block + 5
    assert not sched.blocks.can_allocate_with_hits(49, [], 5)
    assert not sched.blocks.can_allocate(9, 5)
    hits = sched.blocks.find_cached_blocks(req(prompt))
    assert len(hits) == 12 and sched.blocks.num_blocks_to_admit(49, hits) == 1
    assert sched.blocks.can_allocate_with_hits(49, hits, 5)
    sched.add_request("b", prompt, greedy(1))
    plan = sched.schedule()
    assert plan is not None and [ns.num_cached_tokens for ns in plan.new_seqs] == [48]


def test_preempted_request_rehits_its_own_blocks() -> None:
    # 2 requests whose decodes outgrow a 12-block pool: the newer one is preempted, and
    # its re-admission finds its surviving blocks
    sched = make("sarathi", chunk_size=64, num_blocks=12)
    arrivals = {
        0: [
            ("a", list(range(100, 117)), greedy(14, ignore_eos=True)),
            ("b", list(range(200, 217)), greedy(14, ignore_eos=True)),
        ]
    }
    res = drive(sched, arrivals)
    off = drive(make("sarathi", caching=False, chunk_size=64, num_blocks=12), arrivals)
    assert res.outputs == off.outputs
    st = sched.stats()
    assert st.num_preemptions >= 1
    assert st.prefix_cache_preempted_requests >= 1
    assert st.prefix_cache_preempted_hits > 0
    assert st.prefix_cache_preempted_queries > 0
    assert st.prefix_cache_requests == 2 and st.prefix_cache_hits == 0


def test_caching_off_is_the_old_behaviour() -> None:
    bm = BlockManager(BS, 6)
    a = req(list(range(100, 109)), "a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 0 and bm.find_cached_blocks(req(a.prompt_token_ids)) == []
    bm.free(a)
    assert list(bm._free) == [3, 4, 5, 0, 1, 2]  # FIFO, freed blocks appended in order
    # the scheduler: the same plans as caching off always gave (no num_cached_tokens)
    arrivals = shared_prefix_workload()
    res = drive(make(caching=False), arrivals)
    for it in res.iters:
        assert all(ns.num_cached_tokens == 0 for ns in it.plan.new_seqs)
    assert make(caching=False).stats().prefix_caching is False


def test_plan_of_a_hit_roundtrips() -> None:
    import msgspec

    sched = make()
    prompt = list(range(100, 113))
    drive(sched, {0: [("a", prompt, greedy(1))]})
    assert sched.blocks.num_cached_blocks == 3
    sched.add_request("b", prompt, greedy(1))
    plan = sched.schedule()
    assert plan is not None and plan.new_seqs[0].num_cached_tokens == 12
    raw = msgspec.msgpack.encode(plan)
    assert msgspec.msgpack.decode(raw, type=BatchPlan) == plan
    # a NewSeq from before the field existed (5 entries) decodes as starting at 0
    old = msgspec.msgpack.encode([0, [1, 2], 2, SamplingParams(), 7])
    assert msgspec.msgpack.decode(old, type=NewSeq).num_cached_tokens == 0


def test_reset_prefix_cache_request_through_the_service() -> None:
    sched = make()
    svc = SchedulerService(sched, num_detokenizers=1)
    w = FakeWorker(BS, 64)
    prompt = list(range(100, 113))
    drive(sched, {0: [("a", prompt, greedy(1))]}, worker=w)
    assert sched.blocks.num_cached_blocks == 3
    sched.add_request("long", prompt, greedy(5, ignore_eos=True))
    acts = SchedulerActions()
    plan = svc.next_plan()
    assert plan is not None
    svc.on_inbound(ResetPrefixCache("x"), acts)
    assert not acts.to_frontend  # deferred while the plan is in flight
    svc.on_result(w.run(plan), acts)
    [answer] = acts.to_frontend
    assert isinstance(answer, StatsAnswer) and answer.request_id == "x"
    assert answer.stats["reset"] is False and "in use" in answer.stats["error"]
    sched.abort("long")
    acts = SchedulerActions()
    svc.on_inbound(ResetPrefixCache("y"), acts)
    assert acts.to_frontend == [StatsAnswer("y", {"reset": True, "error": ""})]
    assert sched.blocks.num_cached_blocks == 0
    assert svc.stats()["prefix_cache_hits"] == 12


def test_frontend_routes_reset_like_stats() -> None:
    import msgspec

    from sarazmq.frontend.service import FrontendService
    from sarazmq.protocol.client import ResetPrefixCacheRequest, StatsReply

    fe = FrontendService(None)
    raw = msgspec.msgpack.encode(ResetPrefixCacheRequest(request_id="q1"))
    acts = fe.on_client_frame(b"id", raw)
    [to_sched] = acts.to_scheduler
    assert isinstance(to_sched, ResetPrefixCache)
    back = fe.on_engine_message(StatsAnswer(to_sched.request_id, {"reset": False, "error": "busy"}))
    [(ident, reply)] = back.to_clients
    assert ident == b"id" and isinstance(reply, StatsReply) and reply.request_id == "q1"
    assert reply.stats["reset"] is False and reply.stats["error"] == "busy"


# ------------------------------------------------------------------------------ replay


def test_ideal_hits_follow_the_engine_rule() -> None:
    from sarazmq.replay.describe import ideal_prefix_hits

    a = list(range(100, 120))  # 20 tokens: 5 blocks
    assert ideal_prefix_hits([a], BS) == (20, 0)
    assert ideal_prefix_hits([a, a], BS) == (40, 16)  # at most length - 1, whole blocks
    assert ideal_prefix_hits([a, [*a, 1]], BS) == (41, 20)
    b = list(a)
    b[6] = 0
    assert ideal_prefix_hits([a, b], BS) == (40, 4)  # contiguous from block 0 only
    assert ideal_prefix_hits([a[:3], a[:3]], BS) == (6, 0)


def test_mooncake_prefix_sharing_describe_and_summary() -> None:
    from pathlib import Path

    from sarazmq.replay.describe import describe, format_header
    from sarazmq.replay.metrics import IterationSample, summarize
    from sarazmq.replay.report import format_table
    from sarazmq.replay.workload import WorkloadSpec, build_workload

    trace = Path(__file__).parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if not trace.is_file():
        pytest.skip("no Mooncake trace")
    spec = WorkloadSpec(
        vocab_size=49152,
        trace_path=str(trace),
        max_requests=40,
        arrivals="all_at_once",
        prefix_sharing=True,
        max_input_tokens=2048,
    )
    requests = build_workload(spec)
    info = describe(spec, requests)
    ps = info["prefix_sharing"]
    assert ps["trace_block_tokens"] == 512 and ps["block_size_divides"]
    assert 0 < ps["ideal_hit_rate"] < 1
    assert "ideal hit rate" in format_header(info)
    odd = describe(WorkloadSpec(**{**spec.to_dict(), "length_scale": 0.3}), requests, 16)
    assert not odd["prefix_sharing"]["block_size_divides"]  # 154 tokens
    its = [
        IterationSample(0, 1.0, 2.0, 100, 0, 1, cache_queries=100, cache_hits=0),
        IterationSample(1, 2.0, 3.0, 10, 1, 2, cache_queries=100, cache_hits=90),
        IterationSample(2, 3.0, 4.0, 10, 1, 2, preempted_cache_queries=50, preempted_cache_hits=48),
    ]
    summary = summarize([], its)
    assert summary["prefix_cache"] == {
        "queries": 200,
        "hits": 90,
        "hit_rate": 0.45,
        "preempted_queries": 50,
        "preempted_hits": 48,
        "preempted_hit_rate": 0.96,
    }
    table = format_table({**summary, "workload": info})
    assert "prefix cache: 90/200 prompt tokens hit (45.0 %)" in table
    assert "ideal (infinite cache)" in table


def test_iteration_records_carry_the_hits() -> None:
    sched = make()
    w = FakeWorker(BS, 64)
    prompt = list(range(100, 113))
    drive(sched, {0: [("a", prompt, greedy(1))]}, worker=w)
    drive(sched, {0: [("b", prompt, greedy(1))]}, worker=w)
    recs = list(sched.iteration_records)
    assert sum(r.cache_queries for r in recs) == 26
    assert sum(r.cache_hits for r in recs) == 12
    assert recs[-1].cache_hits == 12


# ------------------------------------------------------------------------------ real model

SYSTEM = (
    "You are a careful assistant for a shipping company. Answer questions about parcels, "
    "delivery windows, customs forms and returns. Be brief, polite and precise, and never "
    "invent tracking numbers. If a question is outside shipping, say so and stop. "
)
QUESTIONS = [
    "Where is my parcel?",
    "How long does delivery to Norway take, and do I need a customs form for a gift?",
    "Can I return shoes?",
    "What is the weight limit for a standard parcel sent by air freight to Japan?",
    "Tell me a joke.",
    "My box arrived damaged.",
]
MODEL_CONFIGS = [
    ("sarathi", 8),
    ("sarathi", 64),
    ("sarathi", 512),
    ("vllm", 512),
    ("orca", 512),
    ("fastertransformer", 512),
    ("simple_chunking", 64),
]


@pytest.fixture(scope="module")
def llm():
    from sarazmq import LLM

    # float32 and the float GGUF matmuls: caching changes how prompts are chunked; bf16 or
    # int8 roundings would follow that
    return LLM(
        num_kv_blocks=160,
        max_model_len=1024,
        max_num_seqs=16,
        dtype="float32",
        gguf_matmul="float",
    )


@pytest.fixture(scope="module")
def model_prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    system = tok(SYSTEM * 2)["input_ids"]  # ~100 tokens shared by every prompt
    return [system + tok(q)["input_ids"] for q in QUESTIONS]


def _run(
    llm,
    prompts,
    *,
    caching: bool,
    policy: str,
    chunk: int,
    num_blocks: int | None = None,
    max_tokens: int = 12,
    fresh: bool = True,
):
    if fresh:
        llm.engine.replace_scheduler(
            SchedulerConfig(policy=policy, chunk_size=chunk, max_num_seqs=16), num_blocks
        )
        llm.engine.scheduler.blocks.enable_caching = caching
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.model
@pytest.mark.parametrize(("policy", "chunk"), MODEL_CONFIGS)
def test_model_greedy_same_with_caching_cold_and_warm(llm, model_prompts, policy, chunk) -> None:
    off = _run(llm, model_prompts, caching=False, policy=policy, chunk=chunk)
    assert llm.engine.scheduler.stats().prefix_cache_hits == 0
    cold = _run(llm, model_prompts, caching=True, policy=policy, chunk=chunk)
    warm = _run(llm, model_prompts, caching=True, policy=policy, chunk=chunk, fresh=False)
    assert cold == off
    assert warm == off
    st = llm.engine.scheduler.stats()
    # warm: every prompt hits at least the shared system prompt
    assert st.prefix_cache_hits >= len(model_prompts) * 96


@pytest.mark.model
def test_model_greedy_same_after_eviction_and_preemption(llm, model_prompts) -> None:
    other = [list(reversed(p)) for p in model_prompts]  # same lengths, nothing shared
    off = _run(llm, model_prompts, caching=False, policy="sarathi", chunk=64)
    # a small pool: the second set evicts the first set's blocks
    _run(llm, model_prompts, caching=True, policy="sarathi", chunk=64, num_blocks=40)
    _run(llm, other, caching=True, policy="sarathi", chunk=64, fresh=False)
    assert llm.engine.scheduler.stats().num_evictions > 0
    again = _run(llm, model_prompts, caching=True, policy="sarathi", chunk=64, fresh=False)
    assert again == off
    # preemption: longer outputs in a pool too small for all the decodes
    few = model_prompts[:3]
    long_off = _run(llm, few, caching=False, policy="sarathi", chunk=64, max_tokens=24)
    long_on = _run(llm, few, caching=True, policy="sarathi", chunk=64, num_blocks=10, max_tokens=24)
    st = llm.engine.scheduler.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_preempted_hits > 0
    assert long_on == long_off


@pytest.mark.model
def test_model_multi_turn_reuses_generated_tokens(llm) -> None:
    """A conversation resent whole every turn hits the previous turn's prompt and
    reply blocks, and answers exactly as without caching."""
    tok = llm.tokenizer

    def converse(caching: bool) -> tuple[list[list[int]], list[int]]:
        llm.engine.replace_scheduler(SchedulerConfig(policy="sarathi", chunk_size=64))
        llm.engine.scheduler.blocks.enable_caching = caching
        history = tok(SYSTEM)["input_ids"]
        replies, hits = [], []
        for q in QUESTIONS[:4]:
            history = history + tok(" User: " + q + " Assistant:")["input_ids"]
            before = llm.engine.scheduler.stats().prefix_cache_hits
            [out] = llm.generate([history], SamplingParams(temperature=0.0, max_tokens=10))
            hits.append(llm.engine.scheduler.stats().prefix_cache_hits - before)
            replies.append(out.token_ids)
            history = history + out.token_ids
        return replies, hits

    off, _ = converse(False)
    on, hits = converse(True)
    assert on == off
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])


@pytest.mark.model
def test_deployment_hits_salt_and_reset_through_the_sdk() -> None:
    """Multi-process: a repeated prompt hits, another cache_salt does not, and
    reset_prefix_cache goes SDK -> frontend -> scheduler, refused while a request holds
    blocks."""
    import threading
    import time

    from sarazmq.client import Client, EngineError
    from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig
    from sarazmq.procs.launcher import Deployment

    cfg = EngineConfig(
        dtype="float32",
        gguf_matmul="float",
        scheduler=SchedulerConfig(chunk_size=64, max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks=256),
    )
    prompt = SYSTEM * 2
    p = SamplingParams(temperature=0.0, max_tokens=8)
    with Deployment(cfg, DeploymentConfig()) as dep, Client(dep.endpoint) as client:
        first = client.generate(prompt, p)
        s1 = client.stats()
        again = client.generate(prompt, p)
        s2 = client.stats()
        assert again.token_ids == first.token_ids
        assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] >= 96
        salted = client.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=8, cache_salt="t")
        )
        assert salted.token_ids == first.token_ids
        assert client.stats()["prefix_cache_hits"] == s2["prefix_cache_hits"]
        # refused while a request holds blocks
        started = threading.Event()
        outs: list = []

        def long_run() -> None:
            for d in client.stream(prompt, SamplingParams(max_tokens=48, ignore_eos=True)):
                started.set()
                outs.append(d)

        t = threading.Thread(target=long_run)
        t.start()
        assert started.wait(60)
        with pytest.raises(EngineError, match="in use"):
            client.reset_prefix_cache()
        t.join(300)
        assert not t.is_alive() and outs and outs[-1].finish_reason == "length"
        deadline = time.monotonic() + 60
        while client.stats()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()["num_cached_blocks"] > 0
        client.reset_prefix_cache()
        s3 = client.stats()
        assert s3["num_cached_blocks"] == 0
        assert client.generate(prompt, p).token_ids == first.token_ids  # cold again
        assert client.stats()["prefix_cache_hits"] == s3["prefix_cache_hits"]
