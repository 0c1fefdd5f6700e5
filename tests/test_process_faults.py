"""Process faults over a real `sarazmq serve --restart on-failure` (issue 5, item 5).

kill -9 of each process kind in turn during generation: every in-flight client gets an
EngineError within 10 s, the old processes are all gone, the launcher restarts the
deployment on the same endpoint and a new request succeeds. Then SIGTERM drains: a
request in flight ends with finish_reason "abort" (or finishes), every process exits 0,
no process and no ipc file is left. kill -9 of the launcher itself leaves no process
and no file either. (The no-restart path, exit non-zero, is
tests/test_deployment.py::test_kill_worker_errors_every_request_and_launcher_exits_nonzero.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from proc_utils import alive, sarazmq_children

from sarazmq.client import Client, EngineError
from sarazmq.model.tiny import write_tiny_llama
from sarazmq.sampling_params import SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
KINDS = ("frontend", "scheduler", "worker", "detokenizer")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def children(pid: int) -> dict[int, str]:
    """pid -> process kind of every sarazmq child of `pid`."""
    return {
        p: cmd.split("sarazmq.procs.", 1)[1].split()[0] for p, cmd in sarazmq_children(pid).items()
    }


def wait_healthy(endpoint: str, timeout: float) -> float:
    t0 = time.monotonic()
    reason = ""
    while time.monotonic() - t0 < timeout:
        with Client(endpoint, heartbeat_timeout=5.0) as c:
            report = c.health(timeout=20)
        if report.healthy:
            return time.monotonic() - t0
        reason = report.reason
        time.sleep(1.0)
    raise AssertionError(f"not healthy after {timeout} s: {reason}")


def streams_until_killed(endpoint: str, victim: int, n: int = 3) -> list[float]:
    """Starts n long streams, kills `victim` once all produce tokens; seconds to each error."""
    errors: list[float] = []
    started = [threading.Event() for _ in range(n)]
    with Client(endpoint) as client:

        def run(i: int) -> None:
            try:
                for _ in client.stream(f"Tell me a long story, number {i}.", LONG):
                    started[i].set()
            except EngineError:
                errors.append(time.monotonic())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(180), "streams did not start"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(30)
    assert len(errors) == n, f"{len(errors)} of {n} streams got an error"
    return [t - killed_at for t in errors]


def test_kill_each_kind_restarts_then_sigterm_drains(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/faults.ipc"
    log = tmp_path / "serve.log"
    # fmt: off
    cmd = [
        sys.executable, "-m", "sarazmq.cli", "serve", "--endpoint", endpoint,
        "--restart", "on-failure", "--max-restarts", "4", "--drain-timeout", "3",
        "--chunk-size", "64", "--max-model-len", "512", "--num-kv-blocks", "128",
        "--threads", "1", "--detokenizers", "2", "--dtype", "float32",
    ]
    # fmt: on
    with open(log, "w") as err:
        serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    report: dict[str, str] = {}
    all_pids: list[int] = []
    try:
        assert serve.stdout is not None  # stdout=PIPE
        line = serve.stdout.readline()
        assert "serving" in line, log.read_text()[-3000:]
        rundir = line.rsplit("internal sockets in ", 1)[1].strip()
        for kind in KINDS:
            up = wait_healthy(endpoint, 300)
            procs = children(serve.pid)
            assert sorted(procs.values()) == sorted(
                ["frontend", "scheduler", "worker", "detokenizer", "detokenizer"]
            ), procs
            all_pids += list(procs)
            victim = next(pid for pid, k in procs.items() if k == kind)
            delays = streams_until_killed(endpoint, victim)
            assert max(delays) < 10, (kind, delays)
            # every process of the killed incarnation goes (none orphaned), the launcher
            # stays and starts new ones
            deadline = time.monotonic() + 20
            while alive(list(procs)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert alive(list(procs)) == [], (kind, alive(list(procs)))
            assert serve.poll() is None, log.read_text()[-3000:]
            report[kind] = f"errors after {max(delays):.2f} s (healthy {up:.0f} s after start)"
        wait_healthy(endpoint, 300)
        with Client(endpoint) as c:
            out = c.generate(
                "The capital of France is", SamplingParams(temperature=0, max_tokens=4)
            )
        assert out.finish_reason in ("stop", "length") and out.token_ids
        procs = children(serve.pid)
        all_pids += list(procs)
        # SIGTERM drains: the long request is aborted at the drain deadline, with a reason
        finals: list[str] = []
        started = threading.Event()
        with Client(endpoint) as c:

            def run_long() -> None:
                reason = ""
                for d in c.stream("Count to a million:", LONG):
                    started.set()
                    reason = d.finish_reason
                finals.append(reason)

            t = threading.Thread(target=run_long)
            t.start()
            assert started.wait(120)
            t0 = time.monotonic()
            serve.send_signal(signal.SIGTERM)
            t.join(30)
            assert finals == ["abort"], finals
            code = serve.wait(60)
        stopped_after = time.monotonic() - t0
        assert code == 0, log.read_text()[-3000:]
        tail = log.read_text()
        assert "drained (0 finished, 1 aborted); stopped, every process exited 0" in tail, tail
        # every incarnation's processes stopped on SIGTERM, none had to be killed (a worker
        # or detokenizer whose SIGTERM landed on a library thread used to sit in recv)
        assert "did not stop on SIGTERM" not in tail, tail
        assert alive(all_pids) == []
        assert not os.path.exists(endpoint[len("ipc://") :])
        assert not os.path.exists(rundir)
        report["SIGTERM"] = f"in-flight request aborted; all exited 0 after {stopped_after:.1f} s"
        print("\nprocess faults:", report)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_kill_launcher_leaves_no_process_and_no_file(tmp_path: Path, tiny_model: str) -> None:
    """kill -9 of `serve` itself: its children die with it (PR_SET_PDEATHSIG) and the
    frontend removes the run directory and the public ipc file on the way out."""
    endpoint = f"ipc://{tmp_path}/launcher.ipc"
    # fmt: off
    cmd = [
        sys.executable, "-m", "sarazmq.cli", "serve", "--endpoint", endpoint,
        "--model", tiny_model,
        "--max-model-len", "256", "--num-kv-blocks", "32", "--threads", "1",
        "--dtype", "float32",
    ]
    # fmt: on
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert serve.stdout is not None  # stdout=PIPE
        line = serve.stdout.readline()
        assert "serving" in line
        rundir = line.rsplit("internal sockets in ", 1)[1].strip()
        procs = list(children(serve.pid))
        assert len(procs) == 4 and os.path.exists(rundir)
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(procs) or os.path.exists(rundir)):
            time.sleep(0.1)
        assert alive(procs) == []
        assert not os.path.exists(rundir)
        assert not os.path.exists(endpoint[len("ipc://") :])
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
