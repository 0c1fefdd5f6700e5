"""The dashboard's data path without a browser: the iteration cursor, the feed's
snapshots, and the hub that polls only while someone watches."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from sarazmq.api.cursor import IterationCursor
from sarazmq.api.dashboard import DashboardFeed, DashboardHub, DashboardSettings, percentile


def rec(step: int, prefill: int = 0, decode: int = 0, budget: int = 0, **kw: Any) -> dict:
    return {
        "step": step,
        "start": float(step),
        "end": step + 0.25,
        "num_prefill_tokens": prefill,
        "num_decode_tokens": decode,
        "token_budget": budget,
        "num_seqs": 1,
        **kw,
    }


def stats(done: int, iterations: list[dict] | None = None, **kw: Any) -> dict:
    out: dict[str, Any] = {
        "num_iterations": done,
        "num_running": 0,
        "num_waiting": 0,
        "num_total_blocks": 100,
        "num_free_blocks": 100,
        **kw,
    }
    if iterations is not None:
        out["iterations"] = iterations
    return out


# ---------------------------------------------------------------- cursor


def test_cursor_counts_from_now_or_from_a_backlog() -> None:
    now = IterationCursor()
    assert now.next_step == -1
    assert now.take(stats(10)) == []
    assert now.next_step == 11  # what /metrics does: the engine's history is not counted
    back = IterationCursor(backlog=4)
    back.take(stats(10))
    assert back.next_step == 7
    new = back.take(stats(10, [rec(s) for s in range(7, 11)]))
    assert [r["step"] for r in new] == [7, 8, 9, 10] and back.next_step == 11
    assert back.take(stats(10, [rec(10)])) == []  # never twice
    with pytest.raises(ValueError, match="backlog"):
        IterationCursor(backlog=-1)


def test_cursor_keeps_one_position_per_replica_and_follows_a_restart() -> None:
    cursor = IterationCursor()
    replicas = [
        {"instance": 0, "num_iterations": 5},
        {"instance": 1, "num_iterations": 2},
    ]
    cursor.take({"replicas": replicas})
    assert cursor.next_step == 3  # the lowest: one query asks every replica from there
    its = [rec(3, instance=1), rec(4, instance=1), rec(5, instance=0), rec(6, instance=0)]
    replicas = [{"instance": 0, "num_iterations": 6}, {"instance": 1, "num_iterations": 4}]
    new = cursor.take({"replicas": replicas, "iterations": its})
    assert [(r["instance"], r["step"]) for r in new] == [(1, 3), (1, 4), (0, 6)]
    # replica 1 restarted: it numbers its steps from 1 again
    replicas = [{"instance": 0, "num_iterations": 6}, {"instance": 1, "num_iterations": 1}]
    cursor.take({"replicas": replicas})
    new = cursor.take({"replicas": replicas, "iterations": [rec(2, instance=1)]})
    assert [(r["instance"], r["step"]) for r in new] == [(1, 2)]


# ---------------------------------------------------------------- feed


def test_feed_snapshot_has_the_last_iterations_and_the_engine_state() -> None:
    feed = DashboardFeed("m", DashboardSettings(max_iterations=3))
    feed.observe_stats(stats(5))
    assert feed.query_from == 3
    feed.observe_stats(
        stats(
            5,
            [rec(3, 60, 4, 64), rec(4, 0, 5, 0), rec(5, 12, 5, 64)],
            num_running=5,
            num_waiting=2,
            num_free_blocks=75,
            prefix_caching=True,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            prefix_cache_preempted_queries=20,
            prefix_cache_preempted_hits=20,
        )
    )
    feed.observe_stats(stats(6, [rec(6, 30, 5, 64)]))
    snap = feed.snapshot()
    its = snap["iterations"]["0"]
    assert [i["step"] for i in its] == [4, 5, 6]  # max_iterations kept, oldest dropped
    assert its[-1] == {
        "step": 6,
        "start": 6.0,
        "end": 6.25,
        "prefill": 30,
        "decode": 5,
        "budget": 64,
        "seqs": 1,
        "preempted": 0,
        "forward_s": 0,
    }
    (engine,) = snap["engines"]
    assert engine["num_running"] == 0 and engine["kv_usage"] == 0.0  # the latest stats
    feed.observe_stats(
        stats(
            6,
            [],
            num_free_blocks=75,
            prefix_caching=True,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            prefix_cache_preempted_queries=20,
            prefix_cache_preempted_hits=20,
        )
    )
    (engine,) = feed.snapshot()["engines"]
    assert engine["kv_usage"] == pytest.approx(0.25)
    assert (engine["prefix_cache_hits"], engine["prefix_cache_queries"]) == (60, 120)
    assert engine["prefix_cache_hit_rate"] == pytest.approx(0.5)


def test_feed_latency_percentiles_over_a_sliding_window() -> None:
    now = [0.0]
    feed = DashboardFeed("m", DashboardSettings(window_s=10.0), clock=lambda: now[0])
    feed.observe_request(100.0, [100.5, 100.6, 100.8])  # ttft 0.5, gaps 0.1 0.2
    now[0] = 5.0
    feed.observe_request(200.0, [201.0, 201.3])  # ttft 1.0, gap 0.3
    lat = feed.snapshot()["latency"]
    assert lat["num_requests"] == 2 and lat["num_gaps"] == 3
    assert lat["ttft_s"]["p50"] == pytest.approx(0.5)
    assert lat["ttft_s"]["p99"] == pytest.approx(1.0)
    assert lat["tbt_s"]["p99"] == pytest.approx(0.3)
    now[0] = 12.0  # the first request left the window; the counts stay
    snap = feed.snapshot()
    assert snap["latency"]["num_requests"] == 1
    assert snap["latency"]["ttft_s"]["p50"] == pytest.approx(1.0)
    assert snap["requests"] == {"finished": 2, "output_tokens": 5}


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0 and percentile([], 50) == 0.0


def test_feed_reset_watches_a_new_engine() -> None:
    feed = DashboardFeed("m")
    feed.observe_stats(stats(3))
    feed.observe_stats(stats(3, [rec(1), rec(2), rec(3)]))
    feed.observe_request(1.0, [1.5])
    feed.reset(label="vllm")
    snap = feed.snapshot()
    assert snap["label"] == "vllm" and snap["iterations"] == {}
    assert snap["requests"]["finished"] == 0 and feed.query_from == -1


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_iterations"):
        DashboardSettings(max_iterations=0)
    with pytest.raises(ValueError, match="interval_s"):
        DashboardSettings(interval_s=0)


# ---------------------------------------------------------------- hub


def test_hub_polls_only_while_someone_watches() -> None:
    queries: list[int] = []
    done = [0]

    async def engine_stats(iterations_from: int) -> dict:
        queries.append(iterations_from)
        done[0] += 1
        its = [rec(s) for s in range(max(iterations_from, 1), done[0] + 1)]
        return stats(done[0], its if iterations_from >= 0 else None)

    async def main() -> None:
        feed = DashboardFeed("m", DashboardSettings(interval_s=0.01))
        hub = DashboardHub(feed, engine_stats)
        snapshots = []
        async with contextlib.aclosing(hub.subscribe()) as stream:
            async for snap in stream:
                snapshots.append(snap)
                if len(snapshots) == 4:
                    break
        assert hub.num_viewers == 0
        assert all("requests" in snap for snap in snapshots)  # never an empty first one
        polls = hub.num_polls
        await asyncio.sleep(0.1)
        assert hub.num_polls <= polls + 1  # the poll stops with the last viewer
        steps = [i["step"] for i in snapshots[-1]["iterations"]["0"]]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3  # none lost or twice
        assert queries[0] == -1  # where the engine is, then its backlog
        await hub.close()

    asyncio.run(main())


def test_hub_shows_an_engine_that_does_not_answer() -> None:
    async def silent(iterations_from: int) -> dict:
        raise TimeoutError("stats request timed out after 5.0 s")

    async def main() -> None:
        hub = DashboardHub(DashboardFeed("m"), silent)
        await hub.poll_once()
        assert "timed out" in hub.feed.snapshot()["error"]

    asyncio.run(main())


def test_viewers_of_one_poll_share_its_snapshot() -> None:
    """Two viewers: one snapshot per poll (the window's percentiles are sorted once)."""

    async def engine_stats(iterations_from: int) -> dict:
        return stats(1, [] if iterations_from >= 0 else None)

    async def first(hub: DashboardHub) -> dict:
        async with contextlib.aclosing(hub.subscribe()) as stream:
            async for snap in stream:
                return snap
        raise AssertionError("no snapshot")

    async def main() -> None:
        hub = DashboardHub(DashboardFeed("m", DashboardSettings(interval_s=5.0)), engine_stats)
        a, b = await asyncio.gather(first(hub), first(hub))
        assert a is b and hub.num_polls == 1
        await hub.close()

    asyncio.run(main())
