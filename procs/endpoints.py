"""Endpoint policy: where a deployment's sockets live and which public endpoints are allowed.

Internal sockets are ipc files in the deployment's private 0700 run directory. The public
endpoint is ipc:// anywhere, or tcp:// on loopback, or tcp:// on any address only with
CurveZMQ keys (vLLM's CVE-2025-30202 was a socket bound to tcp://* without them).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

import msgspec

from sarazmq.config import CurveKeys


class Endpoints(msgspec.Struct):
    """Every socket address of one deployment; each PULL is bound by its owner."""

    public: str
    scheduler_in: str
    frontend_in: str
    worker_plans: list[str]
    worker_result: str
    detokenizers: list[str]
    launcher: str
    dist_init: str


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_endpoints(
    rundir: str, public: str | None, num_workers: int, num_detokenizers: int
) -> Endpoints:
    """The deployment's endpoints: ipc files in `rundir` (the public one too unless
    given) and a fresh loopback port for torch.distributed's rendezvous."""
    ipc = f"ipc://{rundir}"
    return Endpoints(
        public=public or f"{ipc}/public.ipc",
        scheduler_in=f"{ipc}/scheduler.ipc",
        frontend_in=f"{ipc}/frontend.ipc",
        worker_plans=[f"{ipc}/worker{r}.ipc" for r in range(num_workers)],
        worker_result=f"{ipc}/result.ipc",
        detokenizers=[f"{ipc}/detok{i}.ipc" for i in range(num_detokenizers)],
        launcher=f"{ipc}/launcher.ipc",
        dist_init=f"tcp://127.0.0.1:{free_tcp_port()}",
    )


def ipc_path(endpoint: str) -> str | None:
    """The file of an ipc:// endpoint (None for another transport)."""
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_public_endpoint(endpoint: str, curve: CurveKeys | None) -> None:
    """ipc:// anywhere; tcp:// on loopback, or on any address only with CurveZMQ keys."""
    if endpoint.startswith("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {endpoint!r} must be ipc://PATH or tcp://HOST:PORT")
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if not is_loopback_host(host) and curve is None:
        raise ValueError(
            f"refusing to serve on non-loopback {endpoint!r} without CurveZMQ keys: anyone who "
            f"can reach it could use the engine. Generate keys with `sarazmq keys` and pass "
            f"--curve-key-file, or bind tcp://127.0.0.1:PORT"
        )


def check_ipc_free(endpoint: str) -> None:
    """Refuses an ipc endpoint that a live process is serving on (libzmq would silently
    take the path over); removes a stale socket file left by a dead one."""
    path = ipc_path(endpoint)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: nobody listens
        return
    except OSError as e:
        raise ValueError(f"endpoint {endpoint!r} exists and cannot be probed: {e}") from None
    finally:
        probe.close()
    raise ValueError(f"endpoint {endpoint!r} is in use by another running process")


def check_http_bind(host: str, api_key: str | None) -> None:
    """A non-loopback address serves anyone who can reach it: refuse it without a key."""
    if not is_loopback_host(host) and not api_key:
        raise ValueError(
            f"refusing to serve HTTP on non-loopback {host!r} without an API key: anyone who "
            "can reach it could use the engine. Pass --api-key or --api-key-file, or bind "
            "127.0.0.1"
        )
