"""The live dashboard's data: what the scheduler reports, turned into what a page draws.

`DashboardFeed` is socket-free (tests drive it): it takes the scheduler's stats with
their new iteration records (`observe_stats`) and finished requests' token times
(`observe_request`), and makes JSON snapshots: the last iterations (prefill-chunk
tokens, decode tokens, the policy's token budget, time), the queues, KV use and
prefix-cache counters per engine instance, and TTFT/TBT percentiles over a sliding
window. `DashboardHub` polls the engine for it while anyone watches (one poll serves
every viewer) and hands each viewer the newest snapshot; nothing is asked of the
scheduler while nobody does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sarazmq.api.cursor import IterationCursor

#: percentiles shown for TTFT and TBT
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class DashboardSettings:
    """max_iterations: iterations kept per instance (bars in the chart); window_s: the
    sliding window of the latency percentiles; interval_s: seconds between polls."""

    max_iterations: int = 240
    window_s: float = 60.0
    interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations={self.max_iterations} must be >= 1")
        if not self.window_s > 0:
            raise ValueError(f"window_s={self.window_s} must be > 0")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s={self.interval_s} must be > 0")


# iteration record fields sent to the page, under shorter names
_ITERATION_FIELDS = (
    ("step", "step"),
    ("start", "start"),
    ("end", "end"),
    ("num_prefill_tokens", "prefill"),
    ("num_decode_tokens", "decode"),
    ("token_budget", "budget"),
    ("num_seqs", "seqs"),
    ("num_preempted", "preempted"),
    ("forward_s", "forward_s"),
)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of ascending values, nearest rank; 0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def _engine_summary(s: Mapping[str, Any]) -> dict[str, Any]:
    total = int(s.get("num_total_blocks", 0))
    free = int(s.get("num_free_blocks", 0))
    queries = sum(
        int(s.get(k, 0)) for k in ("prefix_cache_queries", "prefix_cache_preempted_queries")
    )
    hits = sum(int(s.get(k, 0)) for k in ("prefix_cache_hits", "prefix_cache_preempted_hits"))
    return {
        "instance": int(s.get("instance", 0)),
        "alive": bool(s.get("alive", True)),
        "num_running": int(s.get("num_running", 0)),
        "num_waiting": int(s.get("num_waiting", 0)),
        "kv_usage": 1.0 - free / total if total else 0.0,
        "num_total_blocks": total,
        "num_free_blocks": free,
        "num_iterations": int(s.get("num_iterations", 0)),
        "num_preemptions": int(s.get("num_preemptions", 0)),
        "num_finished": int(s.get("num_finished", 0)),
        "prefix_caching": bool(s.get("prefix_caching", False)),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "tbt_slo": float(s.get("tbt_slo", 0.0)),
        "budget_mean_chunk": float(s.get("budget_mean_chunk", 0.0)),
        "latency_model_mape": float(s.get("latency_model_mape", 0.0)),
    }


class DashboardFeed:
    """The dashboard's state; thread-safe (a replay feeds it from another thread).

    clock: seconds for the latency window (finish times of requests are taken on it);
    api: whether the page is served beside the OpenAI API (its links to /chat and
    /metrics lead somewhere; not in `replay --dashboard`).
    """

    def __init__(
        self,
        model_name: str,
        settings: DashboardSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        api: bool = True,
    ) -> None:
        self.model_name = model_name
        self.settings = settings or DashboardSettings()
        self.clock = clock
        self.api = api
        self.label = ""
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.cursor = IterationCursor(backlog=self.settings.max_iterations)
        self._iterations: dict[int, deque[dict[str, Any]]] = {}
        self._engines: list[dict[str, Any]] = []
        # (finish time, ttft, gaps) per finished request, oldest first
        self._latencies: deque[tuple[float, float, list[float]]] = deque()
        self._requests = 0
        self._output_tokens = 0
        self._error = ""
        self._polled_at = 0.0

    def reset(self, label: str = "") -> None:
        """Forgets everything (a new engine is watched from now on, named `label`)."""
        with self._lock:
            self._reset()
            self.label = label

    @property
    def query_from(self) -> int:
        """`iterations_from` for the next stats query."""
        with self._lock:
            return self.cursor.next_step

    def observe_stats(self, stats: Mapping[str, Any]) -> None:
        """Stats answered to `stats(iterations_from=query_from)`."""
        with self._lock:
            for it in self.cursor.take(stats):
                instance = int(it.get("instance", 0))
                kept = self._iterations.setdefault(
                    instance, deque(maxlen=self.settings.max_iterations)
                )
                kept.append({short: it.get(name, 0) for name, short in _ITERATION_FIELDS})
            replicas = stats.get("replicas")
            self._engines = [_engine_summary(r) for r in (replicas or [stats])]
            self._error = ""
            self._polled_at = self.clock()

    def observe_error(self, message: str) -> None:
        """The engine did not answer the last poll."""
        with self._lock:
            self._error = message

    def observe_request(self, arrival_time: float, token_times: Sequence[float]) -> None:
        """A finished request's arrival and token times (the engine's clock)."""
        now = self.clock()
        with self._lock:
            self._requests += 1
            self._output_tokens += len(token_times)
            if token_times and arrival_time:
                gaps = [b - a for a, b in zip(token_times, token_times[1:])]
                self._latencies.append((now, max(0.0, token_times[0] - arrival_time), gaps))
            self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.settings.window_s
        while self._latencies and self._latencies[0][0] < horizon:
            self._latencies.popleft()

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, JSON-ready."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            ttft = sorted(t for _, t, _ in self._latencies)
            tbt = sorted(g for _, _, gaps in self._latencies for g in gaps)
            return {
                "model": self.model_name,
                "label": self.label,
                "api": self.api,
                "error": self._error,
                "age_s": now - self._polled_at if self._polled_at else None,
                "interval_s": self.settings.interval_s,
                "engines": [dict(e) for e in self._engines],
                "iterations": {str(i): list(its) for i, its in sorted(self._iterations.items())},
                "requests": {
                    "finished": self._requests,
                    "output_tokens": self._output_tokens,
                },
                "latency": {
                    "window_s": self.settings.window_s,
                    "num_requests": len(ttft),
                    "num_gaps": len(tbt),
                    "ttft_s": {f"p{q}": percentile(ttft, q) for q in PERCENTILES},
                    "tbt_s": {f"p{q}": percentile(tbt, q) for q in PERCENTILES},
                },
            }


StatsQuery = Callable[[int], Awaitable[Mapping[str, Any]]]


class DashboardHub:
    """Polls the engine every `interval_s` while at least one viewer is subscribed.

    stats: `iterations_from` -> the engine's stats (an `AsyncClient.stats` call).
    """

    def __init__(self, feed: DashboardFeed, stats: StatsQuery) -> None:
        self.feed = feed
        self.stats = stats
        self.num_viewers = 0
        self.num_polls = 0
        self.latest: dict[str, Any] = {}
        self._version = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def poll_once(self) -> None:
        """One stats query into the feed (an unanswered one is shown as an error)."""
        try:
            if self.feed.query_from < 0:  # first poll: where the engine is, then the backlog
                self.feed.observe_stats(await self.stats(-1))
            stats = await self.stats(self.feed.query_from)
        except Exception as e:  # noqa: BLE001 - the page shows why the engine is silent
            self.feed.observe_error(f"{type(e).__name__}: {e}")
        else:
            self.feed.observe_stats(stats)
        self.num_polls += 1
        # one snapshot per poll for every viewer (the percentiles sort the window once)
        self.latest = self.feed.snapshot()
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def _run(self) -> None:
        while self.num_viewers > 0:
            await self.poll_once()
            await asyncio.sleep(self.feed.settings.interval_s)

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        """Snapshots, one per poll, for as long as the caller iterates."""
        self.num_viewers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            seen = -1 if self._version else 0  # before the first poll: wait for it
            while True:
                if seen == self._version:
                    await self._changed.wait()
                seen = self._version
                yield self.latest
        finally:
            self.num_viewers -= 1

    async def close(self) -> None:
        """Stops polling (the server is shutting down)."""
        self.num_viewers = 0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
