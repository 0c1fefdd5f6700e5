"""Sarathi-Serve's serving metrics from per-request and per-iteration records.

All times are seconds on one monotonic clock shared by the client and the server (the
client's send time and the server's timestamps are comparable). Definitions, for a
request r with arrival a (client send time) and output-token times t_1 <= ... <= t_n
(server iteration-end times):

- TTFT = t_1 - a (time to first token, queueing and prefill included).
- TBT = every gap t_{i+1} - t_i, pooled over all requests (time between tokens).
- TPOT = (t_n - t_1) / (n - 1) per request with n >= 2 (the first token excluded).
- end-to-end latency = t_n - a.
- scheduling delay = first_scheduled - a (time before any of its prefill ran).
- decode stall = the longest TBT of the request (n >= 2).
- ingress delay = server_arrival - a (client -> server transport), when known.
- client TTFT / client end-to-end latency: the same from client_token_times_s, when given.
- throughput over the makespan (first arrival -> last token of any request): completed
  requests/s, their prompt tokens/s and output tokens/s.
- goodput: a request is good when it completed without error, its own TTFT <= slo_ttft
  (if given) and its own P99 TBT <= slo_tbt (if given; a request with fewer than 2
  tokens has no TBT and passes that test). goodput_fraction = good / all requests
  (errors count against it), goodput_rps = good / makespan.

Requests with an error are counted but left out of every latency distribution.
Distributions are summarized as count, mean, p50, p90, p99 and max (numpy percentiles,
linear interpolation); an empty one has count 0 and None elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sarazmq.scheduler import IterationShape, shape_of_fields

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What a replay learned about one request (times in seconds, one clock).

    arrival_s: client send time. server_arrival_s: when the server accepted it.
    first_scheduled_s: start of the first iteration that ran any of its prefill.
    token_times_s: server iteration-end time of each output token.
    client_token_times_s: when the client received each token (optional).
    finish_reason: "length", "stop", "abort", ... (None if it never finished).
    error: empty when the request succeeded.
    """

    request_id: str
    arrival_s: float
    server_arrival_s: float | None
    first_scheduled_s: float | None
    token_times_s: list[float]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    num_preemptions: int = 0
    error: str = ""
    client_token_times_s: list[float] | None = None

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class IterationSample:
    """One scheduler iteration: when it ran and what its batch held.

    cache_queries / cache_hits: prompt tokens of the requests first admitted in it and
    how many of them came from the prefix cache; preempted_cache_*: the same for
    re-admissions after a preemption (the scheduler's `IterationRecord`).
    num_prefill_seqs ... num_sampled: the rest of its `IterationShape`; forward_s: the
    worker's own forward time; token_budget: the tokens its policy let it hold (0: no
    token budget bounded it).
    """

    step: int
    start_s: float
    end_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    cache_queries: int = 0
    cache_hits: int = 0
    preempted_cache_queries: int = 0
    preempted_cache_hits: int = 0
    num_prefill_seqs: int = 0
    prefill_attention_pairs: int = 0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    num_sampled: int = 0
    forward_s: float = 0.0
    token_budget: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], **override: Any) -> IterationSample:
        """The sample of one scheduler `IterationRecord` as a dict (the stats answer's
        form; start/end are named without _s there). Missing counters are 0."""
        values: dict[str, Any] = {
            "step": int(rec["step"]),
            "start_s": float(rec["start"]),
            "end_s": float(rec["end"]),
        }
        for f in dataclasses.fields(cls):
            if f.name not in values:
                default = 0 if f.default is dataclasses.MISSING else f.default
                values[f.name] = type(default)(rec.get(f.name, default))
        return cls(**{**values, **override})

    def shape(self) -> IterationShape:
        """The iteration's shape (what the latency model predicts from)."""
        return shape_of_fields(self)


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request derived metrics (None where undefined)."""

    request_id: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    scheduling_delay_s: float | None
    decode_stall_s: float | None
    tbt_p99_s: float | None
    ingress_delay_s: float | None
    client_ttft_s: float | None
    client_e2e_s: float | None
    tbts_s: list[float] = field(default_factory=list)


def distribution(values: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """count, mean, p50, p90, p99, max of `values` (None for an empty sequence)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    pct = np.percentile(arr, PERCENTILES)  # linear interpolation (numpy's default)
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)},
        "max": float(arr.max()),
    }


def request_metrics(record: RequestRecord) -> RequestMetrics:
    """Derived metrics of one request (see the module docstring for the definitions)."""
    times = np.asarray(record.token_times_s, dtype=np.float64)
    gaps = np.diff(times)  # [n-1]
    if gaps.size and gaps.min() < 0:
        raise ValueError(f"request {record.request_id!r}: token_times_s is not non-decreasing")
    n = times.size
    a = record.arrival_s
    client = record.client_token_times_s
    return RequestMetrics(
        request_id=record.request_id,
        ttft_s=float(times[0] - a) if n else None,
        tpot_s=float((times[-1] - times[0]) / (n - 1)) if n >= 2 else None,
        e2e_s=float(times[-1] - a) if n else None,
        scheduling_delay_s=(
            record.first_scheduled_s - a if record.first_scheduled_s is not None else None
        ),
        decode_stall_s=float(gaps.max()) if gaps.size else None,
        tbt_p99_s=float(np.percentile(gaps, 99)) if gaps.size else None,
        ingress_delay_s=(
            record.server_arrival_s - a if record.server_arrival_s is not None else None
        ),
        client_ttft_s=float(client[0] - a) if client else None,
        client_e2e_s=float(client[-1] - a) if client else None,
        tbts_s=gaps.tolist(),
    )


def _values(metrics: Sequence[RequestMetrics], name: str) -> list[float]:
    return [v for m in metrics if (v := getattr(m, name)) is not None]


def _iteration_summary(iterations: Sequence[IterationSample]) -> dict[str, Any]:
    prefill = [it.num_prefill_tokens for it in iterations]
    decode = [it.num_decode_tokens for it in iterations]
    return {
        "count": len(iterations),
        "duration_s": distribution([it.duration_s for it in iterations]),
        "prefill_tokens": distribution(prefill),
        "decode_tokens": distribution(decode),
        "batch_size": distribution([it.num_seqs for it in iterations]),
        "num_mixed": sum(1 for p, d in zip(prefill, decode, strict=True) if p and d),
        "num_prefill_only": sum(1 for p, d in zip(prefill, decode, strict=True) if p and not d),
        "num_decode_only": sum(1 for p, d in zip(prefill, decode, strict=True) if d and not p),
        "busy_s": float(sum(it.duration_s for it in iterations)),
    }


def prefix_cache_summary(iterations: Sequence[IterationSample]) -> dict[str, Any]:
    """The prefix cache over the run's iterations, in tokens: queries and hits at first
    admissions (hit_rate = hits / queries, None without queries), and separately at
    re-admissions after a preemption."""
    q = sum(it.cache_queries for it in iterations)
    h = sum(it.cache_hits for it in iterations)
    pq = sum(it.preempted_cache_queries for it in iterations)
    ph = sum(it.preempted_cache_hits for it in iterations)
    return {
        "queries": q,
        "hits": h,
        "hit_rate": h / q if q else None,
        "preempted_queries": pq,
        "preempted_hits": ph,
        "preempted_hit_rate": ph / pq if pq else None,
    }


def summarize(
    records: Sequence[RequestRecord],
    iterations: Sequence[IterationSample] = (),
    slo_ttft: float | None = None,
    slo_tbt: float | None = None,
) -> dict[str, Any]:
    """Sarathi's metrics over a run, JSON-serializable (see the module docstring).

    Keys: num_requests, num_completed, num_errors, errors (first few messages),
    finish_reasons; distributions ttft_s, tbt_s, tpot_s, e2e_s, scheduling_delay_s,
    decode_stall_s, ingress_delay_s, client_ttft_s, client_e2e_s, preemptions;
    total_preemptions, num_preempted_requests; makespan_s and throughput (requests_per_s,
    input_tokens_per_s, output_tokens_per_s); goodput (slo_ttft_s, slo_tbt_s, num_good,
    fraction, requests_per_s); iterations (count, duration, prefill/decode tokens, batch
    size, mixed/prefill-only/decode-only counts, busy_s, busy_fraction); prefix_cache
    (`prefix_cache_summary`).
    """
    if slo_ttft is not None and slo_ttft <= 0:
        raise ValueError(f"slo_ttft={slo_ttft} must be > 0")
    if slo_tbt is not None and slo_tbt <= 0:
        raise ValueError(f"slo_tbt={slo_tbt} must be > 0")
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    per_req = [request_metrics(r) for r in done]

    starts = [r.arrival_s for r in records]
    ends = [r.token_times_s[-1] for r in done if r.token_times_s]
    makespan = max(ends) - min(starts) if ends and starts else 0.0

    def rate(x: float) -> float | None:
        return x / makespan if makespan > 0 else None

    good = 0
    for m in per_req:
        if m.ttft_s is None:
            continue
        if slo_ttft is not None and m.ttft_s > slo_ttft:
            continue
        if slo_tbt is not None and m.tbt_p99_s is not None and m.tbt_p99_s > slo_tbt:
            continue
        good += 1

    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": len(failed),
        "errors": [f"{r.request_id}: {r.error}" for r in failed[:10]],
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in done)),
        "ttft_s": distribution(_values(per_req, "ttft_s")),
        "tbt_s": distribution([g for m in per_req for g in m.tbts_s]),
        "tpot_s": distribution(_values(per_req, "tpot_s")),
        "e2e_s": distribution(_values(per_req, "e2e_s")),
        "scheduling_delay_s": distribution(_values(per_req, "scheduling_delay_s")),
        "decode_stall_s": distribution(_values(per_req, "decode_stall_s")),
        "ingress_delay_s": distribution(_values(per_req, "ingress_delay_s")),
        "client_ttft_s": distribution(_values(per_req, "client_ttft_s")),
        "client_e2e_s": distribution(_values(per_req, "client_e2e_s")),
        "preemptions": distribution([r.num_preemptions for r in done]),
        "total_preemptions": int(sum(r.num_preemptions for r in records)),
        "num_preempted_requests": sum(1 for r in records if r.num_preemptions > 0),
        "makespan_s": float(makespan),
        "throughput": {
            "requests_per_s": rate(len(done)),
            "input_tokens_per_s": rate(sum(r.num_prompt_tokens for r in done)),
            "output_tokens_per_s": rate(sum(r.num_output_tokens for r in done)),
        },
        "goodput": {
            "slo_ttft_s": slo_ttft,
            "slo_tbt_s": slo_tbt,
            "num_good": good,
            "fraction": good / len(records) if records else None,
            "requests_per_s": rate(good),
        },
    }
    it = _iteration_summary(iterations)
    it["busy_fraction"] = it["busy_s"] / makespan if makespan > 0 else None
    out["iterations"] = it
    out["prefix_cache"] = prefix_cache_summary(iterations)
    return out


def slo_goodput(
    records: Sequence[RequestRecord], slo_ttft: float, slo_tpot: float, num_gpus: int
) -> dict[str, Any]:
    """DistServe's goodput: a request is good when it completed without error, its TTFT
    <= slo_ttft and its TPOT (time per output token after the first) <= slo_tpot (a
    request of one output token has no TPOT and passes that test). attainment = good /
    all requests; requests_per_s = good / makespan; per_gpu = that over `num_gpus`."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1")
    good = 0
    starts = [r.arrival_s for r in records]
    ends = [r.token_times_s[-1] for r in records if r.ok and r.token_times_s]
    for r in records:
        if not r.ok:
            continue
        m = request_metrics(r)
        if m.ttft_s is not None and m.ttft_s <= slo_ttft and (m.tpot_s or 0.0) <= slo_tpot:
            good += 1
    makespan = max(ends) - min(starts) if ends and starts else 0.0
    rps = good / makespan if makespan > 0 else 0.0
    return {
        "slo_ttft_s": slo_ttft,
        "slo_tpot_s": slo_tpot,
        "num_good": good,
        "attainment": good / len(records) if records else 0.0,
        "requests_per_s": rps,
        "num_gpus": num_gpus,
        "per_gpu": rps / num_gpus,
    }
