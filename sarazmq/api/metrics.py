"""Prometheus metrics of the HTTP server, named as vLLM's (`sarazmq:` instead of `vllm:`).

Gauges and engine-wide counters come from the scheduler's own stats, read when /metrics is
scraped; the latency histograms are fed by the engine's server-side timestamps (arrival,
end of the iteration of each token) of the requests this server handled; the iteration
histogram by the scheduler's iteration records since the previous scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sarazmq.api.cursor import IterationCursor
from sarazmq.outputs import RequestOutput

PREFIX = "sarazmq:"
# vLLM's buckets (seconds; tokens)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _SchedulerCollector(Collector):
    """Gauges and counters from the latest scheduler stats (set before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Mapping[str, Any] = {}

    def collect(self) -> Iterable[Any]:
        replicas = self.stats.get("replicas")
        if not replicas:
            yield from self._collect(self.stats, ["model_name"], [self.model_name])
            return
        # data-parallel replicas: every gauge and counter per replica, and whether it is up
        up = GaugeMetricFamily(
            PREFIX + "replica_up", "1 when the replica serves", labels=["model_name", "replica"]
        )
        for r in replicas:
            up.add_metric([self.model_name, str(r["instance"])], 1.0 if r.get("alive") else 0.0)
        yield up
        families: dict[str, Any] = {}
        for r in replicas:
            if not r.get("alive"):
                continue
            values = [self.model_name, str(r["instance"])]
            for fam in self._collect(r, ["model_name", "replica"], values):
                if fam.name in families:
                    families[fam.name].samples.extend(fam.samples)
                else:
                    families[fam.name] = fam
        yield from families.values()

    def _collect(self, s: Mapping[str, Any], labels: list[str], values: list[str]) -> Iterable[Any]:
        """One engine's (or one replica's) gauges and counters, labelled `values`."""
        gauges = {
            "num_requests_running": ("requests running on the engine", s.get("num_running")),
            "num_requests_waiting": ("requests waiting to be admitted", s.get("num_waiting")),
        }
        if s.get("tbt_slo"):  # the adaptive budget (--tbt-slo) and its latency model
            gauges.update(
                {
                    "tbt_slo_seconds": ("time-between-tokens target", s.get("tbt_slo")),
                    "latency_model_mape": (
                        "iteration-time model: mean abs error / measured time, out of sample",
                        s.get("latency_model_mape", 0.0),
                    ),
                    "latency_model_p95_error": (
                        "iteration-time model: P95 of abs error / measured time",
                        s.get("latency_model_p95_error", 0.0),
                    ),
                    "budget_mean_chunk_tokens": (
                        "mean prefill chunk of iterations with decodes running",
                        s.get("budget_mean_chunk", 0.0),
                    ),
                }
            )
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            if value is not None:
                g.add_metric(values, float(value))
            yield g
        total, free = s.get("num_total_blocks"), s.get("num_free_blocks")
        g = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "KV-cache usage (1 = full)", labels=labels
        )
        if total:
            g.add_metric(values, 1.0 - float(free or 0) / float(total))
        yield g
        counters = {
            "num_preemptions": ("recompute preemptions so far", ("num_preemptions",)),
            "prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                ("prefix_cache_queries", "prefix_cache_preempted_queries"),
            ),
            "prefix_cache_hits": (
                "prompt tokens found in the prefix cache",
                ("prefix_cache_hits", "prefix_cache_preempted_hits"),
            ),
        }
        for name, (doc, keys) in counters.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            if s:  # the stats omit counters still at 0
                c.add_metric(values, float(sum(s.get(k, 0) for k in keys)))
            yield c


class ServerMetrics:
    """The server's registry; `observe_request` per finished request, `render` per scrape."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self._scheduler = _SchedulerCollector(model_name)
        self.registry.register(self._scheduler)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "prefill tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.requests = counter("request_success", "requests finished (any reason)")
        self.ttft = histogram(
            "time_to_first_token_seconds", "arrival to first token (engine clock)", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "time between tokens (engine clock)", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "arrival to last token (engine clock)", E2E_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "tokens per engine iteration", TOKEN_BUCKETS
        )
        self.cursor = IterationCursor()  # iteration records not yet in the histogram

    @property
    def next_step(self) -> int:
        """The first iteration record not yet observed (-1: none read yet)."""
        return self.cursor.next_step

    def observe_request(self, out: RequestOutput) -> None:
        """A request this server handled has finished: its counts and latencies."""
        label = self.model_name
        self.requests.labels(label).inc()
        self.prompt_tokens.labels(label).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(label).inc(len(out.token_ids))
        times = out.token_times
        if not times or not out.arrival_time:
            return
        self.ttft.labels(label).observe(max(0.0, times[0] - out.arrival_time))
        for a, b in zip(times, times[1:]):
            self.itl.labels(label).observe(max(0.0, b - a))
        self.e2e.labels(label).observe(max(0.0, times[-1] - out.arrival_time))

    def observe_stats(self, stats: Mapping[str, Any]) -> None:
        """The scheduler's stats (with "iterations" since `next_step` when asked for);
        the first stats seen start the count (not the engine's whole history)."""
        self._scheduler.stats = stats
        for it in self.cursor.take(stats):
            tokens = int(it.get("num_prefill_tokens", 0)) + int(it.get("num_decode_tokens", 0))
            self.iteration_tokens.labels(self.model_name).observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
