"""Prefill/decode disaggregation in simulated time (DistServe, Splitwise, Mooncake).

P prefill instances and D decode instances, each a real scheduler on its own simulated
clock, behind one router (`sarazmq.router`, with instance roles):

    arrival:             routed to a prefill instance (the config's router), admitted
                         there to compute its prompt and sample its first token
                         (max_tokens 1); that token is the request's first
    prefill finishes:    a decode instance is chosen (least-load over the decode
                         instances); the prompt's KV (prompt tokens x kv_bytes_per_token)
                         crosses that instance's inbound link (one transfer at a time, at
                         `kv_link_bytes_s`, plus a fixed latency) and is then queued there
    transfer done:       the decode instance queues the request with its prompt's KV and
                         first token (`Scheduler.add_prefilled_request`); admitted when
                         its pool has room, it decodes the rest

The prefill instances run the config's prefill policy (sarathi: chunked; vllm: whole
prompts), the decode instances their own (which, with every prompt already computed, makes
decode-only batches). A transfer is modelled into the decode instance's memory once it
is admitted: the KV waits on the link side (host memory) while the pool is full, and the
prefill instance frees its blocks when the first token is out (DistServe keeps them until
the transfer is pulled; at the loads simulated here the prefill pools do not fill).

The outcome is a `FleetOutcome` (instances: the prefill ones first) whose records hold
each request's whole life: TTFT from the prefill side, then every decoded token; its
`transfers` the bytes and link times.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sarazmq.config import EngineConfig
from sarazmq.protocol.worker import StepResult
from sarazmq.replay.metrics import RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.router import (
    InstanceTable,
    Router,
    RouterConfig,
    prompt_block_keys,
    routing_policy,
)
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import LatencyModel, Request, Scheduler, build_scheduler
from sarazmq.sim.common import (
    DUMMY_TOKEN,
    SimClock,
    StandinPrompts,
    admit,
    collect,
    fewer_gc_passes,
    request_record,
)
from sarazmq.sim.fleet import FleetOutcome, ReplicaCounters
from sarazmq.validation import InvalidRequestError

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class DisaggSpec:
    """num_prefill / num_decode: instances of each role; kv_link_bytes_s: the bandwidth
    of each decode instance's inbound KV link; kv_bytes_per_token: K and V of every layer
    for one token, as stored; link_latency_s: fixed cost of one transfer."""

    num_prefill: int
    num_decode: int
    kv_link_bytes_s: float
    kv_bytes_per_token: int
    link_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"a disaggregated deployment needs >= 1 prefill and >= 1 decode instance "
                f"(got {self.num_prefill}:{self.num_decode})"
            )
        if not self.kv_link_bytes_s > 0 or self.kv_bytes_per_token < 1:
            raise ValueError("kv_link_bytes_s must be > 0 and kv_bytes_per_token >= 1")
        if not self.link_latency_s >= 0:
            raise ValueError("link_latency_s must be >= 0")


class _Instance:
    """One simulated instance: its scheduler, clock, plan in flight and counters."""

    def __init__(self, index: int, role: str, config: EngineConfig, latency: LatencyModel):
        self.index, self.role = index, role
        self.clock = SimClock(0.0)
        self.scheduler: Scheduler = build_scheduler(config, (), self.clock)
        self.latency = latency
        self.busy = False
        self.num_added = 0
        self.plan: tuple[int, float, list[int]] = (0, 0.0, [])
        self.live: dict[str, tuple[int, Request]] = {}
        self.counters = ReplicaCounters()


@fewer_gc_passes
def simulate_disaggregated(
    requests: Sequence[WorkloadRequest],
    prefill_config: EngineConfig,
    decode_config: EngineConfig,
    prefill_latency: LatencyModel,
    decode_latency: LatencyModel,
    spec: DisaggSpec,
    *,
    overhead_s: float = 0.0,
    exact_prompts: bool | None = None,
) -> FleetOutcome:
    """Simulates `requests` (arrival_s ascending) on a disaggregated deployment (see the
    module docstring); prefill_config / decode_config: each role's resolved config
    (`sim.run.sim_engine_config`), pp 1, no TBT target."""
    for cfg in (prefill_config, decode_config):
        if cfg.pipeline_parallel_size != 1 or cfg.scheduler.tbt_slo:
            raise ValueError("disaggregated instances are simulated with pp=1 and no tbt_slo")
    arrivals = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("requests must be sorted by arrival_s")
    wall0 = time.perf_counter()
    insts = [
        _Instance(i, PREFILL, prefill_config, prefill_latency) for i in range(spec.num_prefill)
    ]
    insts += [
        _Instance(spec.num_prefill + i, DECODE, decode_config, decode_latency)
        for i in range(spec.num_decode)
    ]
    table = InstanceTable(
        [i.scheduler.config.chunk_size for i in insts],
        [i.scheduler.blocks.num_total_blocks for i in insts],
        [i.role for i in insts],
    )
    router = Router(
        RouterConfig(policy=routing_policy(prefill_config)), table, prefill_config.cache.block_size
    )
    decode_router = Router(RouterConfig(policy="least-load"), table, decode_config.cache.block_size)
    prompts = StandinPrompts(
        exact_prompts, prefill_config.cache.enable_prefix_caching, len(requests)
    )
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    prompt_of: dict[int, list[int]] = {}
    link_free = [0.0] * len(insts)
    transfers: list[tuple[int, float]] = []  # (bytes, seconds on the link incl. queueing)
    events: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload)
    order = 0
    hash_keys = router.config.policy == "cache-aware"
    ITER, XFER = 0, 1

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    def start(inst: _Instance, t: float) -> None:
        inst.clock.now = t
        plan = inst.scheduler.schedule()
        if plan is None:
            inst.busy = False
            return
        inst.busy = True
        dt = inst.latency.predict(inst.scheduler.inflight_shape) + overhead_s
        inst.plan = (plan.step, t, [s.seq_id for s in plan.scheduled if s.sample])
        push(t + dt, ITER, inst.index)

    def report(inst: _Instance) -> None:
        table.on_report(inst.scheduler.load(inst.index, inst.num_added))

    def prefilled(inst: _Instance, req: Request, t: float) -> None:
        """A prompt is done on a prefill instance: its first token is out; send it on."""
        index, _ = inst.live.pop(req.request_id)
        wr = requests[index]
        if req.finish_reason == "error" or wr.output_tokens <= 1:
            records[index] = request_record(req, wr)
            return
        d = decode_router.route([], 0, role=DECODE)
        nbytes = len(req.prompt_token_ids) * spec.kv_bytes_per_token
        begin = max(t, link_free[d])
        end = begin + spec.link_latency_s + nbytes / spec.kv_link_bytes_s
        link_free[d] = end
        transfers.append((nbytes, end - t))
        first = (req.output_token_ids[0], req.token_times[0], req.first_scheduled_time or t)
        push(end, XFER, (index, d, first))

    nxt = 0
    now = 0.0
    while nxt < n or events:
        if nxt < n and (not events or arrivals[nxt] <= events[0][0]):
            now = arrivals[nxt]
            wr = requests[nxt]
            ids = prompts(nxt, wr)
            prompt_of[nxt] = ids
            keys = prompt_block_keys(ids, prefill_config.cache.block_size) if hash_keys else []
            inst = insts[router.route(keys, len(ids), role=PREFILL)]
            inst.clock.now = now
            inst.num_added += 1
            inst.counters.requests += 1
            one = replace(wr, output_tokens=1)  # the prefill side makes the first token
            error = admit(inst.scheduler, one, nxt, ids, now, inst.live)
            if error is not None:
                records[nxt] = error
            report(inst)
            nxt += 1
            if not inst.busy:
                start(inst, now)
            continue
        now, _, kind, payload = heapq.heappop(events)
        if kind == XFER:
            index, d, (token, t_first, t_sched) = payload
            inst = insts[d]
            inst.clock.now = now
            wr = requests[index]
            inst.num_added += 1
            inst.counters.requests += 1
            try:
                inst.scheduler.add_prefilled_request(
                    wr.request_id,
                    prompt_of.pop(index),
                    SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True, temperature=0.0),
                    first_token=token,
                    first_token_time=t_first,
                    first_scheduled_time=t_sched,
                    arrival_time=arrivals[index],
                )
            except InvalidRequestError as e:
                records[index] = RequestRecord(
                    request_id=wr.request_id, arrival_s=arrivals[index], server_arrival_s=None,
                    first_scheduled_s=t_sched, token_times_s=[t_first],
                    num_prompt_tokens=wr.input_tokens, num_output_tokens=1,
                    error=f"InvalidRequestError: {e}",
                )  # fmt: skip
            else:
                req = inst.scheduler.get_request(wr.request_id)
                assert req is not None  # just added
                inst.live[wr.request_id] = (index, req)
            report(inst)
            if not inst.busy:
                start(inst, now)
            continue
        inst = insts[payload]
        inst.clock.now = now
        step, began, sampled = inst.plan
        deltas = inst.scheduler.process_result(
            StepResult(step=step, seq_ids=sampled, token_ids=[DUMMY_TOKEN] * len(sampled),
                       forward_s=now - began)
        )  # fmt: skip
        inst.counters.iterations += 1
        inst.counters.busy_s += now - began
        if inst.role == PREFILL:
            for d in deltas:
                if d.finish_reason and d.request_id in inst.live:
                    prefilled(inst, inst.live[d.request_id][1], now)
        else:
            collect(deltas, inst.live, records, requests)
        report(inst)
        start(inst, now)
    for inst in insts:
        if inst.scheduler.has_unfinished():
            raise RuntimeError(f"{inst.role} instance {inst.index} has unfinished requests")
        stats = inst.scheduler.stats()
        inst.counters.prefix_cache_queries = stats.prefix_cache_queries
        inst.counters.prefix_cache_hits = stats.prefix_cache_hits
    if any(r is None for r in records):
        raise RuntimeError(f"{sum(r is None for r in records)} request(s) left no record")
    nbytes = [b for b, _ in transfers]
    secs = sorted(s for _, s in transfers)
    return FleetOutcome(
        records=[r for r in records if r is not None],
        replicas=[i.counters for i in insts],
        router={**router.counters(), "prefill": spec.num_prefill, "decode": spec.num_decode},
        sim_time_s=now,
        wall_s=time.perf_counter() - wall0,
        num_iterations=sum(i.counters.iterations for i in insts),
        transfers={
            "count": len(transfers),
            "bytes_mean": sum(nbytes) / len(nbytes) if nbytes else 0.0,
            "seconds_mean": sum(secs) / len(secs) if secs else 0.0,
            "seconds_p99": secs[min(len(secs) - 1, int(0.99 * len(secs)))] if secs else 0.0,
        },
    )
