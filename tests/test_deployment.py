"""The multi-process deployment over real processes and the real default model."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from proc_utils import alive as _alive
from proc_utils import sarazmq_children as _children

from sarazmq import LLM
from sarazmq.client import AsyncClient, Client, EngineError, RequestError
from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig, SchedulerConfig
from sarazmq.procs.launcher import Deployment, DeploymentError
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
] * 4  # 32 requests
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def small_config(**kw: object) -> EngineConfig:
    # float32 and the float GGUF matmuls: outputs are compared with the in-process
    # engine's, batched differently, and bf16 or int8 roundings follow how a batch is composed
    kw.setdefault("dtype", "float32")
    kw.setdefault("gguf_matmul", "float")
    kv_cache_dtype = str(kw.pop("kv_cache_dtype", "auto"))
    sched = SchedulerConfig(policy="sarathi", chunk_size=64, max_num_seqs=32, max_model_len=1024)
    cache = CacheConfig(block_size=16, num_blocks=1024, kv_cache_dtype=kv_cache_dtype)
    return EngineConfig(scheduler=sched, cache=cache, **kw)


def small_llm(**kw: object) -> LLM:
    """The in-process engine of `small_config` (float32 for the same reason)."""
    return LLM(
        dtype="float32",
        gguf_matmul="float",
        scheduler="sarathi",
        chunk_size=64,
        max_num_seqs=32,
        max_model_len=1024,
        num_kv_blocks=1024,
        **kw,
    )


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    with Deployment(small_config(), DeploymentConfig(num_detokenizers=2)) as dep:
        yield dep


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy outputs of the in-process engine for PROMPTS."""
    llm = small_llm()
    outs = llm.generate(PROMPTS[:8], GREEDY)
    return {p: o.token_ids for p, o in zip(PROMPTS[:8], outs)}


def wait_for_idle(client: Client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_32_concurrent_streams_sync_client(deployment: Deployment, reference) -> None:
    results: dict[int, tuple[str, list]] = {}
    with Client(deployment.endpoint) as client:

        def run(i: int) -> None:
            deltas = list(client.stream(PROMPTS[i], GREEDY))
            results[i] = ("".join(d.text for d in deltas), deltas)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        finals = {i: client.generate(PROMPTS[i], GREEDY) for i in range(8)}
    assert len(results) == len(PROMPTS)
    for i, (text, deltas) in results.items():
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == reference[PROMPTS[i]], PROMPTS[i]
        assert deltas[-1].finish_reason in ("stop", "length")
        assert text == finals[i % 8].text
        # server timestamps: one per token, non-decreasing, after arrival
        times = [t for d in deltas for t in d.token_times]
        assert len(times) == len(ids) and times == sorted(times)
        assert deltas[0].arrival_time <= deltas[0].first_scheduled_time <= times[0]


def test_32_concurrent_streams_async_client(deployment: Deployment, reference) -> None:
    async def main() -> list[tuple[str, list[int], str]]:
        async with AsyncClient(deployment.endpoint) as client:

            async def one(p: str) -> tuple[str, list[int], str]:
                text, ids, reason = "", [], ""
                async for d in client.stream(p, GREEDY):
                    text += d.text
                    ids += d.token_ids
                    reason = d.finish_reason
                final = await client.generate(p, GREEDY)
                assert final.text == text and final.token_ids == ids
                return text, ids, reason

            return await asyncio.gather(*(one(p) for p in PROMPTS))

    for p, (_text, ids, reason) in zip(PROMPTS, asyncio.run(main())):
        assert ids == reference[p]
        assert reason in ("stop", "length")


def test_bad_input_is_an_error_for_that_request_only(deployment: Deployment) -> None:
    with Client(deployment.endpoint) as client:
        with pytest.raises(RequestError, match="empty"):
            client.generate("", GREEDY)
        with pytest.raises(RequestError, match="context"):
            client.generate(list(range(1, 2000)), GREEDY)
        assert client.generate("Hello", GREEDY).finish_reason in ("stop", "length")


def test_abort_mid_stream_frees_blocks(deployment: Deployment) -> None:
    with Client(deployment.endpoint) as client:
        total = client.stats()["num_total_blocks"]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        rid = client.new_request_id()
        got = []
        for d in client.stream("Count from one to a thousand:", params, request_id=rid):
            got.append(d)
            if len(got) == 3:
                client.abort(rid)
        assert got[-1].finish_reason == "abort"
        assert sum(len(d.token_ids) for d in got) < 400
        stats = wait_for_idle(client)
        assert stats["num_free_blocks"] == total


def test_stop_string_spanning_tokens_frees_blocks(deployment: Deployment) -> None:
    with Client(deployment.endpoint) as client:
        base = client.generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=20)
        )
        assert len(base.text) > 6
        stop = base.text[3:7]  # most likely spans a token boundary; never at the very start
        out = client.generate(
            "The capital of France is",
            SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
        )
        assert out.finish_reason == "stop"
        assert out.text == base.text[: base.text.index(stop)]
        stats = wait_for_idle(client)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_multibyte_text_streams_cleanly(deployment: Deployment) -> None:
    with Client(deployment.endpoint) as client:
        params = SamplingParams(temperature=0, max_tokens=40)
        deltas = list(
            client.chat(
                [{"role": "user", "content": "Say 'こんにちは世界' and 'café' three times."}],
                params,
                stream=True,
            )
        )
        text = "".join(d.text for d in deltas)
        assert all("\ufffd" not in d.text for d in deltas)
        assert (
            text
            == client.chat(
                [{"role": "user", "content": "Say 'こんにちは世界' and 'café' three times."}],
                params,
            ).text
        )


def test_unreachable_engine_is_an_error_not_a_hang(tmp_path) -> None:
    with Client(f"ipc://{tmp_path}/nobody.ipc", heartbeat_timeout=1.0) as client:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="unreachable"):
            client.generate("hi", GREEDY)
        assert time.monotonic() - t0 < 5


def test_tp2_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="--tp 2 does not divide"):
        Deployment(small_config(tensor_parallel_size=2))


def test_deployment_honours_the_engine_seed() -> None:
    """Requests without their own seed get seeds drawn from EngineConfig.seed, in arrival
    order, in a deployment exactly as in `LLM` (the scheduler process once dropped it)."""
    sampled = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[:3]

    def in_process(seed: int) -> list[list[int]]:
        llm = small_llm(seed=seed)
        # one at a time: each request's seed is the next draw of the engine's generator
        return [llm.generate(p, sampled)[0].token_ids for p in prompts]

    expected = in_process(1234)
    with Deployment(small_config(seed=1234)) as dep, Client(dep.endpoint) as c:
        got = [c.generate(p, sampled).token_ids for p in prompts]
    assert got == expected
    # the seed is what made them equal: another seed draws other outputs (in process: a
    # second deployment would cost a start of every process to show the same thing)
    assert in_process(99) != expected


def test_int8_kv_cache_deployment_gives_the_in_process_int8_outputs(
    deployment: Deployment,
) -> None:
    # the cache dtype crosses into the worker process: its logprobs are the in-process
    # int8 engine's exactly (float32), and not the float32 cache's (the tokens alone are
    # mostly the same either way)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)

    def logprobs(outs: list) -> list[list[float]]:
        return [[lp.logprob for lp in o.logprobs] for o in outs]

    prompts = PROMPTS[:2]
    # one request at a time everywhere: the same batches, so the same float32 sums; and
    # the worker on as many threads as this process (other test modules leave one set):
    # where no native kernel reads int8 rows for this dtype (float32 without AVX-512),
    # torch's attention sums in an order that follows the thread count
    llm = small_llm(kv_cache_dtype="int8")
    int8 = logprobs([llm.generate(p, params)[0] for p in prompts])
    with Client(deployment.endpoint) as c:  # the shared deployment: float32 caches
        plain = logprobs([c.generate(p, params) for p in prompts])
    int8_config = small_config(kv_cache_dtype="int8", num_threads=torch.get_num_threads())
    with Deployment(int8_config) as dep, Client(dep.endpoint) as c:
        got = logprobs([c.generate(p, params) for p in prompts])
    assert got == int8
    assert got != plain


@pytest.mark.slow
def test_tp3_equals_tp1(reference) -> None:
    got: dict[str, list[int]] = {}
    with (
        Deployment(small_config(tensor_parallel_size=3, num_threads=1)) as dep,
        Client(dep.endpoint) as c,
    ):
        # all four at once, as the reference was batched: ~13 tp-3 steps where one request
        # at a time took ~50 (the outputs do not depend on the batch: the tests above)
        def run(p: str) -> None:
            got[p] = c.generate(p, GREEDY).token_ids

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert got == {p: reference[p] for p in PROMPTS[:4]}


def test_tbt_target_gives_the_fixed_chunk_outputs(reference) -> None:
    """With --tbt-slo the chunk sizes change from iteration to iteration (and a startup
    calibration runs first); greedy outputs must not: chunking changes nothing."""
    cfg = dataclasses.replace(
        small_config(),
        scheduler=SchedulerConfig(
            policy="sarathi", chunk_size=64, max_num_seqs=32, max_model_len=1024, tbt_slo=0.05
        ),
    )
    with Deployment(cfg) as dep, Client(dep.endpoint) as c:
        outs = [c.generate(p, GREEDY).token_ids for p in PROMPTS[:8]]
        stats = c.stats()
    assert outs == [reference[p] for p in PROMPTS[:8]]
    assert stats["tbt_slo"] == 0.05 and not stats["calibrating"]
    assert stats["latency_model_samples"] > 0 and stats["num_finished"] == 8


def test_async_scheduling_deployment_gives_the_same_outputs(reference) -> None:
    """--async-scheduling: the scheduler process builds plan N+1 while the worker runs
    plan N. Concurrent streams get the in-process (synchronous) engine's tokens; an abort
    mid-stream and a stop string, each with a plan in flight past its end, free every
    block."""
    got: dict[int, list[int]] = {}
    with (
        Deployment(small_config(async_scheduling=True)) as dep,
        Client(dep.endpoint) as client,
    ):

        def run(i: int) -> None:
            got[i] = [t for d in client.stream(PROMPTS[i], GREEDY) for t in d.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        rid = client.new_request_id()
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        deltas = []
        for d in client.stream("Count from one to a thousand:", long, request_id=rid):
            deltas.append(d)
            if len(deltas) == 3:
                client.abort(rid)
        base = client.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
        stop = base.text[3:7]
        cut = client.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
        stats = wait_for_idle(client)
    assert got == {i: reference[PROMPTS[i]] for i in range(16)}
    assert deltas[-1].finish_reason == "abort"
    assert cut.finish_reason == "stop" and cut.text == base.text[: base.text.index(stop)]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["async_scheduling"] and stats["num_overlapped_plans"] > 0


def test_kill_worker_errors_every_request_and_launcher_exits_nonzero(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/kill.ipc"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sarazmq.cli",
            "serve",
            "--endpoint",
            endpoint,
            "--chunk-size",
            "64",
            "--max-model-len",
            "1024",
            "--num-kv-blocks",
            "512",
            "--threads",
            "1",
            "--log-level",
            "ERROR",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = serve.stdout.readline()
        assert "serving" in line, serve.stderr.read() if serve.poll() is not None else line
        from sarazmq.resolve import native_bf16

        # the default dtype is auto, and the startup line says what it became
        want = "bfloat16 (auto" if native_bf16("cpu") else "float32 (auto"
        assert f"dtype {want}" in line, line
        rundir = line.rsplit("internal sockets in ", 1)[1].strip()
        procs = _children(serve.pid)
        assert len(procs) == 4, procs  # worker, scheduler, detokenizer, frontend
        (worker_pid,) = [pid for pid, cmd in procs.items() if "procs.worker" in cmd]
        errors: list[float] = []
        started = [threading.Event() for _ in range(4)]
        with Client(endpoint) as client:
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

            def run(i: int) -> None:
                try:
                    for _ in client.stream("Tell me a long story.", params):
                        started[i].set()
                except EngineError:
                    errors.append(time.monotonic())

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for ev in started:  # every request is generating
                assert ev.wait(180)
            killed_at = time.monotonic()
            os.kill(worker_pid, signal.SIGKILL)
            for t in threads:
                t.join(15)
        assert len(errors) == 4
        assert max(errors) - killed_at < 10
        assert serve.wait(15) != 0
        assert "worker-0" in serve.stderr.read()
        deadline = time.monotonic() + 5
        while _alive(list(procs)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(list(procs)) == []
        assert not os.path.exists(f"{tmp_path}/kill.ipc")
        assert not os.path.exists(rundir)
    finally:
        if serve.poll() is None:
            serve.kill()


def test_ipc_endpoints_are_owner_only(deployment: Deployment) -> None:
    """Internal sockets live in a 0700 directory; the public ipc socket file is 0600."""
    import stat

    assert stat.S_IMODE(os.stat(deployment.rundir).st_mode) == 0o700
    eps = deployment.endpoints
    (inst,) = eps.instances
    internal = [inst.scheduler_in, eps.frontend_in, inst.worker_result, eps.launcher]
    internal += inst.worker_plans + inst.detokenizers
    for ep in [*internal, eps.public]:
        path = ep[len("ipc://") :]
        assert os.path.dirname(path) == deployment.rundir, ep
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, (ep, oct(os.stat(path).st_mode))


def test_startup_failure_is_reported() -> None:
    with pytest.raises((ValueError, DeploymentError), match="model"):
        Deployment(small_config(model="no-such-model"))
