"""The replay driver: sends a workload to a deployment through the client SDK, on time.

`replay` opens one `AsyncClient`, sends each `WorkloadRequest` at its arrival time
(seconds after the replay's start instant) as token ids with `ignore_eos=True` and
`max_tokens=output_tokens`, and streams every response, recording the client's send
time, the time each token reached the client, and the server's timestamps (arrival,
first scheduled, one iteration-end time per token, preemptions). A failed request is
recorded with its error, never raised. At the end it fetches the scheduler's iteration
records of the run (`stats(iterations_from=...)`).

Clocks: the server's timestamps are `time.monotonic()` of the server processes and the
client's are `time.monotonic()` here. CLOCK_MONOTONIC is system-wide on Linux, so the two
are comparable when the client runs on the deployment's machine (always true when
`run_replay` starts the deployment). Against a remote endpoint they are not: then the
server-side latencies are meaningless, and `clock_check` says so.

`run_replay` is the synchronous entry point: it optionally starts a `Deployment` for the
run and tears it down afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from sarazmq.client import AsyncClient
from sarazmq.config import DeploymentConfig, EngineConfig
from sarazmq.replay.metrics import IterationSample, RequestRecord
from sarazmq.replay.workload import WorkloadRequest
from sarazmq.sampling_params import SamplingParams

#: Warm-up request sent before the clock starts (first-call costs of a fresh deployment).
WARMUP_PROMPT_TOKENS = 32
WARMUP_OUTPUT_TOKENS = 4


@dataclass(frozen=True)
class ReplayOutcome:
    """Everything a replay produced.

    records: one per workload request, in workload order.
    iterations: the scheduler's iterations that ran during the replay.
    start_s: the replay's start instant (client monotonic clock); request i was due at
        start_s + requests[i].arrival_s.
    wall_s: from start_s to the last response (and the iteration fetch).
    max_send_lag_s: the latest any request was sent after it was due (event-loop lag or a
        full concurrency limit); large values mean the arrival process was not honoured.
    settings: what the driver knows of the target (endpoint, resolved engine config when
        it started the deployment, the scheduler's counters at the start).
    """

    records: list[RequestRecord]
    iterations: list[IterationSample]
    start_s: float
    wall_s: float
    max_send_lag_s: float
    settings: dict[str, Any] = field(default_factory=dict)


def _sampling_params(req: WorkloadRequest, temperature: float, seed: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=req.output_tokens,
        ignore_eos=True,
        seed=seed,
    )


async def _one_request(
    client: AsyncClient,
    req: WorkloadRequest,
    prompt: list[int],
    params: SamplingParams,
    timeout: float | None,
) -> RequestRecord:
    """Streams one request to its end and records its times; errors become records."""
    token_times: list[float] = []
    client_times: list[float] = []
    num_tokens = 0
    server_arrival: float | None = None
    first_scheduled: float | None = None
    finish_reason: str | None = None
    preemptions = 0
    error = ""
    sent = time.monotonic()
    try:
        async for delta in client.stream(prompt, params, timeout=timeout):
            now = time.monotonic()
            # a delta may carry several tokens (e.g. after a slow client); they share
            # the receive time
            client_times.extend([now] * len(delta.token_ids))
            token_times.extend(delta.token_times)
            num_tokens += len(delta.token_ids)
            if delta.arrival_time:
                server_arrival = delta.arrival_time
            if delta.first_scheduled_time:
                first_scheduled = delta.first_scheduled_time
            preemptions = max(preemptions, delta.num_preemptions)
            if delta.finish_reason:
                finish_reason = delta.finish_reason
    except Exception as e:  # noqa: BLE001 - every failure is recorded, not raised
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not error and finish_reason is None:
        error = "stream ended without a finish reason"
    if not error and finish_reason == "abort":
        error = "aborted by the server"
    if not error and len(token_times) != num_tokens:
        error = f"{num_tokens} tokens but {len(token_times)} token times"
    return RequestRecord(
        request_id=req.request_id,
        arrival_s=sent,
        server_arrival_s=server_arrival,
        first_scheduled_s=first_scheduled,
        token_times_s=token_times if not error else [],
        num_prompt_tokens=len(prompt),
        num_output_tokens=num_tokens,
        finish_reason=finish_reason,
        num_preemptions=preemptions,
        error=error,
        client_token_times_s=client_times if not error else None,
    )


def _steps_from(stats: Mapping[str, Any]) -> dict[int, int]:
    """Per engine instance, the first step after the ones `stats` counts (several
    data-parallel replicas number their steps each on its own)."""
    replicas = stats.get("replicas") or [{"instance": 0, **stats}]
    return {int(r["instance"]): int(r.get("num_iterations", 0)) + 1 for r in replicas}


def _iteration_samples(
    raw: Sequence[dict[str, Any]], steps_from: Mapping[int, int]
) -> list[IterationSample]:
    """The iteration records of the run: each instance's from its own first step."""
    return [
        IterationSample.from_record(it)
        for it in raw
        if int(it["step"]) >= steps_from.get(int(it.get("instance", 0)), 0)
    ]


def warmup_prompt(first: WorkloadRequest) -> list[int]:
    """A short prompt like the workload's first, for the untimed warm-up request."""
    if first.prompts is None:
        return [100] * WARMUP_PROMPT_TOKENS
    n = min(first.input_tokens, WARMUP_PROMPT_TOKENS)
    return first.prompts.tokens(n, first.source_index, first.hash_ids)


SendOne = Callable[[WorkloadRequest, list[int]], Awaitable[RequestRecord]]
#: called with each request's record as it finishes (e.g. `replay --dashboard`)
OnRecord = Callable[[RequestRecord], None]


async def drive(
    requests: Sequence[WorkloadRequest],
    send_one: SendOne,
    *,
    progress: bool,
    concurrency_limit: int | None,
    description: str,
    on_record: OnRecord | None = None,
) -> tuple[list[RequestRecord], float, float]:
    """Sends each request at its arrival time (after the returned start instant) through
    `send_one`, at most `concurrency_limit` in flight; returns the records in workload
    order, the start instant and the largest send lag. `on_record` sees each record as
    its request ends."""
    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    limit = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    bar = tqdm(total=n, desc=description, unit="req", disable=not progress, dynamic_ncols=True)
    errors = 0
    max_lag = 0.0

    async def run(i: int, prompt: list[int]) -> None:
        nonlocal errors
        try:
            rec = await send_one(requests[i], prompt)
        finally:
            if limit is not None:
                limit.release()
        records[i] = rec
        if on_record is not None:
            on_record(rec)
        if rec.error:
            errors += 1
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    try:
        for i, req in enumerate(requests):
            # the prompt is made before waiting, so its cost does not delay the send, and
            # only for requests about to be sent (a whole trace's would not fit)
            prompt = req.prompt_token_ids
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                await limit.acquire()
            max_lag = max(max_lag, time.monotonic() - (start + req.arrival_s))
            tasks.append(asyncio.create_task(run(i, prompt)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    done = [r for r in records if r is not None]
    if len(done) != n:
        raise RuntimeError(f"{n - len(done)} request(s) left no record")
    return done, start, max_lag


async def replay_detailed(
    endpoint: str,
    requests: Sequence[WorkloadRequest],
    *,
    progress: bool = True,
    concurrency_limit: int | None = None,
    temperature: float = 0.0,
    seed: int | None = 0,
    timeout: float | None = None,
    warmup: bool = True,
    heartbeat_timeout: float = 30.0,
    description: str = "replay",
    on_record: OnRecord | None = None,
) -> ReplayOutcome:
    """Replays `requests` against the deployment at `endpoint` (see the module docstring).

    concurrency_limit: at most this many requests in flight; a request due while the
        limit is reached is sent when a slot frees (its arrival is its actual send time).
    temperature / seed: sampling of every request (greedy by default; the seed makes a
        sampled run repeatable).
    timeout: per-request deadline in seconds (None: none); a late request is an error.
    warmup: first send one short request and wait for it, outside the measured run.
    heartbeat_timeout: seconds of engine silence after which requests fail.
    description: the progress bar's label.
    on_record: called with each request's record as it ends.
    """
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit={concurrency_limit} must be >= 1 or None")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 or None")
    n = len(requests)
    async with AsyncClient(endpoint, heartbeat_timeout=heartbeat_timeout) as client:
        if warmup and n:
            await client.generate(
                warmup_prompt(requests[0]),
                SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True),
                timeout=timeout,
            )
        stats0 = await client.stats()
        # records of steps already completed are not ours; a step in flight now is
        # (its requests are the previous user's, but it overlaps our run)
        steps_from = _steps_from(stats0)

        async def send_one(req: WorkloadRequest, prompt: list[int]) -> RequestRecord:
            params = _sampling_params(req, temperature, seed)
            return await _one_request(client, req, prompt, params, timeout)

        records, start, max_lag = await drive(
            requests,
            send_one,
            progress=progress,
            concurrency_limit=concurrency_limit,
            description=description,
            on_record=on_record,
        )
        stats1 = await client.stats(iterations_from=min(steps_from.values()))
        wall = time.monotonic() - start
    iterations = _iteration_samples(stats1.get("iterations", []), steps_from)
    settings = {
        "endpoint": endpoint,
        "server_stats_at_start": {k: v for k, v in stats0.items() if k != "iterations"},
        "server_stats_at_end": {k: v for k, v in stats1.items() if k != "iterations"},
        "concurrency_limit": concurrency_limit,
        "temperature": temperature,
        "seed": seed,
        "warmup": warmup,
    }
    return ReplayOutcome(
        records=records,
        iterations=iterations,
        start_s=start,
        wall_s=wall,
        max_send_lag_s=max_lag,
        settings=settings,
    )


async def replay(
    endpoint: str,
    requests: Sequence[WorkloadRequest],
    *,
    progress: bool = True,
    concurrency_limit: int | None = None,
    **kwargs: Any,
) -> tuple[list[RequestRecord], list[IterationSample]]:
    """Replays `requests` against `endpoint`; returns the request and iteration records.

    See `replay_detailed` for the keyword arguments; this drops the run's extra facts.
    """
    out = await replay_detailed(
        endpoint, requests, progress=progress, concurrency_limit=concurrency_limit, **kwargs
    )
    return out.records, out.iterations


def engine_settings(config: EngineConfig, deployment: DeploymentConfig) -> dict[str, Any]:
    """A resolved engine config as a JSON-ready dict (for summary.json)."""
    return {**dataclasses.asdict(config), "num_detokenizers": deployment.num_detokenizers}


@contextlib.contextmanager
def target(
    endpoint: str | None,
    config: EngineConfig | None,
    deployment: DeploymentConfig | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (endpoint, engine settings): the given endpoint, or that of a Deployment of
    `config` (run as `deployment` says) started here and stopped on exit. Exactly one of
    endpoint and config must be given."""
    if (endpoint is None) == (config is None):
        raise ValueError("give exactly one of endpoint (connect) and config (start one)")
    if endpoint is not None:
        yield endpoint, {"connected": True}
        return
    from sarazmq.procs.launcher import Deployment

    deployment = deployment or DeploymentConfig()
    with Deployment(config, deployment) as dep:  # type: ignore[arg-type]
        yield dep.endpoint, {"connected": False, **engine_settings(dep.config, deployment)}


def run_replay(
    requests: Sequence[WorkloadRequest],
    *,
    endpoint: str | None = None,
    config: EngineConfig | None = None,
    deployment: DeploymentConfig | None = None,
    **kwargs: Any,
) -> ReplayOutcome:
    """Synchronous replay: against `endpoint`, or against a Deployment of `config` started
    for this run and torn down after it. Keyword arguments go to `replay_detailed`; the
    outcome's settings gain "engine" (the resolved config, or {"connected": True})."""
    with target(endpoint, config, deployment) as (ep, engine):
        out = asyncio.run(replay_detailed(ep, requests, **kwargs))
    return dataclasses.replace(out, settings={**out.settings, "engine": engine})


def clock_check(records: Sequence[RequestRecord], tolerance_s: float = 5.0) -> str:
    """ "" if the server's timestamps look comparable with the client's clock, else a
    warning: the median ingress delay (server arrival - client send) should be small and
    not negative beyond a millisecond."""
    delays = sorted(
        r.server_arrival_s - r.arrival_s for r in records if r.server_arrival_s is not None
    )
    if not delays:
        return ""
    median = delays[len(delays) // 2]
    if -1e-3 <= median <= tolerance_s:
        return ""
    return (
        f"median ingress delay (server arrival - client send) is {median:.3f} s: the server's "
        "clock is not this machine's CLOCK_MONOTONIC (remote endpoint?), so server-side "
        "latencies are not meaningful"
    )
