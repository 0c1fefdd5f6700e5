"""The router (sarazmq.router) on synthetic loads, and the fleet simulator built on it."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import sim_config
from test_simulator import Linear

from sarazmq.protocol.engine import InstanceLoad
from sarazmq.replay.metrics import summarize
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.router import (
    InstanceTable,
    NoInstanceError,
    PrefixIndex,
    Router,
    RouterConfig,
    prompt_block_keys,
)
from sarazmq.sim import build_sim_scheduler, simulate
from sarazmq.sim.fleet import simulate_fleet


def _router(policy: str, n: int = 4, budget: int = 512, blocks: int = 1000) -> Router:
    table = InstanceTable([budget] * n, [blocks] * n)
    return Router(RouterConfig(policy=policy), table, block_size=16)


def _keys(prefix: int, n: int) -> list[bytes]:
    """n block keys of a prompt whose blocks all belong to conversation `prefix`."""
    return prompt_block_keys([prefix] * (16 * n), 16)


# ---------------------------------------------------------------------------- pieces


def test_prefix_index_matches_the_longest_prefix_per_instance() -> None:
    idx = PrefixIndex([100, 100, 100])
    a = prompt_block_keys(list(range(16 * 6)), 16)
    idx.insert(0, a[:2])
    idx.insert(1, a[:5])
    idx.insert(2, prompt_block_keys([7] * 64, 16))
    assert idx.match_lengths(a, 0b111) == {0: 2, 1: 5}
    assert idx.match_lengths(a, 0b001) == {0: 2}  # only the candidates
    # keys chain: the same blocks after another start match nothing
    assert idx.match_lengths(prompt_block_keys(list(range(16, 16 * 6)), 16), 0b111) == {}
    idx.clear(1)
    assert idx.match_lengths(a, 0b111) == {0: 2}


def test_prefix_index_forgets_least_recently_routed_beyond_capacity() -> None:
    idx = PrefixIndex([4])
    old, new = _keys(1, 4), _keys(2, 4)  # 3 keys each (the last token is never a hit)
    idx.insert(0, old)
    idx.insert(0, new)  # 6 keys, capacity 4: two of `old` go, from its tail
    assert idx.size(0) == 4
    assert idx.match_lengths(old, 1) == {0: 1}  # its head is still there
    assert idx.match_lengths(new, 1) == {0: 3}
    # a prompt longer than the capacity keeps its head: it matches right after routing
    small = PrefixIndex([8])
    long = _keys(3, 11)  # 10 keys
    small.insert(0, long)
    assert small.match_lengths(long, 1) == {0: 8}
    with pytest.raises(ValueError, match="capacities"):
        PrefixIndex([-1])


def test_table_counts_what_it_sent_until_a_report_includes_it() -> None:
    table = InstanceTable([512, 512], [100, 100])
    table.on_sent(0, 300)
    table.on_sent(0, 200)
    assert table[0].queued_tokens == 500 and table[1].queued_tokens == 0
    # the report includes the first request only (num_added=1); its own queue says 250
    table.on_report(InstanceLoad(0, 1, 1, 0, 250, 10, 100))
    assert table[0].queued_tokens == 250 + 200
    table.on_report(InstanceLoad(0, 2, 0, 2, 0, 40, 100))
    assert table[0].queued_tokens == 0 and table[0].num_running == 2
    assert table[0].kv_use == pytest.approx(0.4)
    table.on_report(InstanceLoad(9, 1, 0, 0, 0, 0, 1))  # unknown instance: ignored
    with pytest.raises(ValueError, match="role"):
        InstanceTable([1], [1], ["both"])


# ---------------------------------------------------------------------------- policies


def test_round_robin_takes_live_instances_in_turn() -> None:
    r = _router("round-robin", n=3)
    assert [r.route([], 10) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.mark_down(1)
    assert {r.route([], 10) for _ in range(4)} == {0, 2}
    r.mark_down(0)
    r.mark_down(2)
    with pytest.raises(NoInstanceError, match="no mixed instance"):
        r.route([], 10)
    r.mark_up(1)
    assert r.route([], 10) == 1


def test_least_load_balances_prefill_work() -> None:
    """Requests of very different sizes, no report in between (the table counts what it
    sent): every instance ends with about the same prefill work, not the same count."""
    rng = random.Random(0)
    r = _router("least-load", n=4)
    sizes = [rng.choice([50, 4000]) for _ in range(200)]
    for s in sizes:
        r.route([], s)
    work = [r.table[i].queued_tokens for i in range(4)]
    assert max(work) - min(work) <= 4000  # within one large request
    assert sum(work) == sum(sizes)


def test_least_load_prefers_fewer_running_decodes_and_a_pool_with_room() -> None:
    r = _router("least-load", n=3)
    r.table.on_report(InstanceLoad(0, 0, 0, 100, 0, 10, 1000))
    r.table.on_report(InstanceLoad(1, 0, 0, 5, 0, 990, 1000))  # pool almost full
    r.table.on_report(InstanceLoad(2, 0, 0, 20, 0, 10, 1000))
    assert r.route([], 100) == 2


def test_cache_aware_keeps_conversations_on_their_instance() -> None:
    """Eight conversations, each turn's prompt extending its previous one: with loads
    reported as drained between turns, every later turn goes where its history is."""
    r = _router("cache-aware", n=4)
    home: dict[int, int] = {}
    for turn in range(1, 6):
        for conv in range(8):
            keys = _keys(conv, 4 * (turn + 1))  # its history is most of every later turn
            where = r.route(keys, 16 * 4 * (turn + 1))
            if turn > 1:
                assert where == home[conv], (turn, conv)
            home[conv] = where
            r.table.on_report(InstanceLoad(where, r.table[where].num_sent, 0, 0, 0, 0, 1000))
    assert len(set(home.values())) == 4  # the first turns spread over every instance
    assert r.num_matched == 8 * 4  # every later turn matched its history


def test_cache_aware_load_bound_spreads_a_hot_prefix() -> None:
    """Every request shares one long prefix and nothing is ever reported done: affinity
    alone would queue all of them on one instance; the bound spreads them."""
    r = _router("cache-aware", n=4)
    counts = [0] * 4
    for i in range(200):
        keys = _keys(99, 32) + prompt_block_keys([i] * 16, 16)  # hot prefix + own block
        counts[r.route(keys, 16 * 33)] += 1
    assert min(counts) > 0
    waits = [r.table[i].prefill_iterations() for i in range(4)]
    cfg = r.config
    assert max(waits) <= min(waits) * (1 + cfg.balance_rel) + cfg.balance_abs + 33 * 16 / 512


def test_cache_aware_ignores_a_short_shared_prefix() -> None:
    """Every prompt opens with the same short system prompt (4 of 32 blocks) and the
    loads drain between requests: a match under `cache_threshold` of the prompt does not
    steer, so the requests spread as least-load spreads them, not onto the holder."""
    r = _router("cache-aware", n=4)
    counts = [0] * 4
    for i in range(40):
        keys = _keys(7, 4) + prompt_block_keys([1000 + i] * (16 * 28), 16)[:28]
        where = r.route(keys, 16 * 32)
        counts[where] += 1
        r.table.on_report(InstanceLoad(where, r.table[where].num_sent, 0, 0, 0, 0, 1000))
    assert counts == [10, 10, 10, 10]
    assert r.num_matched == 0
    # past the threshold the same shared prefix does steer: a prompt that is mostly it
    holder = r.route(_keys(7, 4) + prompt_block_keys([5] * 48, 16)[:3], 16 * 7)
    assert r.num_matched == 1 and counts[holder] >= 10


def test_router_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match=">= 0"):
        RouterConfig(balance_abs=-1)
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(cache_threshold=1.5)


# ---------------------------------------------------------------------------- fleet


class _ConversationPrompts:
    """Conversation c's history: one fixed random stream of ids, so every turn's prompt is
    a prefix of the next turn's (what `PromptSource.tokens` is asked for)."""

    def tokens(self, length: int, source_index: int, hash_ids: tuple[int, ...]) -> list[int]:
        rng = random.Random(source_index)
        return [rng.randrange(2, 2000) for _ in range(length)]


def _conversations(n_conv: int, turns: int, gap: float, seed: int = 0) -> list[WorkloadRequest]:
    """Multi-turn conversations: turn t's prompt is turn t-1's plus 64 new tokens (real
    prompt ids from a PromptSource row, shared by the turns of a conversation)."""
    rng = random.Random(seed)
    src = _ConversationPrompts()
    reqs = []
    t = 0.0
    for turn in range(turns):
        for c in range(n_conv):
            t += rng.expovariate(1 / gap)
            n_in = 128 + 64 * turn
            reqs.append(WorkloadRequest(f"c{c}-t{turn}", t, n_in, 8, c, n_in, 8, (c,), prompts=src))
    return reqs


def test_fleet_of_one_equals_the_single_engine_simulation() -> None:
    reqs = _conversations(4, 3, 0.05)
    one = sim_config(num_blocks=2000, max_model_len=4096, chunk_size=256)
    single = simulate(reqs, build_sim_scheduler(one), Linear(), exact_prompts=True)
    fleet = simulate_fleet(reqs, one, Linear(), exact_prompts=True)
    assert [r.token_times_s for r in fleet.records] == [r.token_times_s for r in single.records]
    assert fleet.num_iterations == single.num_iterations


def test_fleet_cache_aware_hits_more_than_round_robin() -> None:
    reqs = _conversations(13, 5, 0.02)  # 13: round-robin does not keep them by chance
    hit, ttft = {}, {}
    for router in ("round-robin", "cache-aware"):
        cfg = sim_config(
            num_blocks=3000, max_model_len=4096, chunk_size=256, data_parallel_size=4,
            router=router,
        )  # fmt: skip
        out = simulate_fleet(reqs, cfg, Linear(), exact_prompts=True)
        s = out.summary()
        assert s["num_completed"] == len(reqs)
        assert s["fleet"]["replicas"] == 4 and s["fleet"]["router"]["policy"] == router
        hit[router] = out.prefix_hit_rate
        ttft[router] = summarize(out.records)["ttft_s"]["mean"]
    assert hit["cache-aware"] >= 1.5 * hit["round-robin"], hit
    # the hits are prefill not computed: requests start sooner on the whole
    assert ttft["cache-aware"] < ttft["round-robin"], ttft


def test_fleet_refuses_what_it_does_not_model() -> None:
    reqs = _conversations(1, 1, 0.1)
    with pytest.raises(ValueError, match="pp=1"):
        simulate_fleet(
            reqs,
            sim_config(num_blocks=100, max_model_len=512, pipeline_parallel_size=2),
            Linear(),
        )
