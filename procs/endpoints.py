"""Endpoint policy: where a deployment's sockets live and which public endpoints are allowed.

Internal sockets are ipc files in the deployment's private 0700 run directory. The public
endpoint is ipc:// anywhere, or tcp:// on loopback, or tcp:// on any address only with
CurveZMQ keys (vLLM's CVE-2025-30202 was a socket bound to tcp://* without them). A
multi-node deployment adds the node link (tcp, master_port + 1, same rule) and uses
master_addr:master_port for torch.distributed's rendezvous.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

import msgspec

from sarazmq.config import CurveKeys, DeploymentConfig, EngineConfig


class InstanceEndpoints(msgspec.Struct):
    """The sockets of one engine instance (its scheduler, workers and detokenizers) and
    its workers' torch.distributed rendezvous."""

    scheduler_in: str
    worker_plans: list[str]
    worker_result: str
    detokenizers: list[str]
    dist_init: str
    # per worker rank: where a disaggregated deployment's decode workers read its KV
    kv_export: list[str] = []


class Endpoints(msgspec.Struct):
    """Every socket address of one deployment; each PULL is bound by its owner.
    instances: one set per engine instance (data-parallel replicas)."""

    public: str
    frontend_in: str
    launcher: str
    instances: list[InstanceEndpoints]
    # multi-node only: the node link's tcp endpoint (the head binds it, nodes connect)
    # and the head's nodelink process's control socket (from the launcher)
    link: str = ""
    link_control: str = ""


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_size(config: EngineConfig) -> int:
    """How many worker processes (ranks) a deployment runs: tp x pp."""
    return config.tensor_parallel_size * config.pipeline_parallel_size


def node_ranks(num_workers: int, nnodes: int, node_rank: int) -> range:
    """The global worker ranks node `node_rank` hosts: an even, contiguous block."""
    if nnodes < 1 or num_workers % nnodes != 0:
        raise ValueError(
            f"--nnodes {nnodes} does not divide the deployment's {num_workers} worker(s) "
            "(tp x pp): every node hosts the same number of workers"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, {nnodes})")
    per_node = num_workers // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def host_port(host: str, port: int) -> str:
    """host:port for a tcp:// endpoint (IPv6 addresses in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def link_endpoint(dep: DeploymentConfig) -> str:
    """The node link's endpoint: the head binds it, every other node connects to it."""
    return f"tcp://{host_port(dep.master_addr, dep.master_port + 1)}"


def dist_init_method(dep: DeploymentConfig) -> str:
    """torch.distributed's init method for a multi-node deployment (the head's rank 0
    hosts the TCP store)."""
    return f"tcp://{host_port(dep.master_addr, dep.master_port)}"


def node_instances(num_instances: int, nnodes: int, node_rank: int) -> range:
    """The data-parallel replicas node `node_rank` runs whole: an even, contiguous block."""
    if num_instances % nnodes != 0:
        raise ValueError(
            f"--nnodes {nnodes} does not divide --dp {num_instances}: with data-parallel "
            "replicas every node runs the same number of whole replicas"
        )
    per_node = num_instances // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def check_multinode(config: EngineConfig, dep: DeploymentConfig) -> range:
    """Validates a multi-node deployment's settings; returns this node's worker ranks
    (with data-parallel replicas, every rank of each replica the node runs whole)."""
    if config.data_parallel_size > 1:
        node_instances(config.data_parallel_size, dep.nnodes, dep.node_rank)
        ranks = range(world_size(config))
    else:
        ranks = node_ranks(world_size(config), dep.nnodes, dep.node_rank)
    if dep.nnodes > 1:
        try:
            check_public_endpoint(link_endpoint(dep), dep.curve)
        except ValueError:
            raise ValueError(
                f"refusing a node link on non-loopback --master-addr {dep.master_addr!r} "
                "without CurveZMQ keys: anyone who can reach it could join as a node. "
                "Generate keys with `sarazmq keys` and give every node --curve-key-file"
            ) from None
    return ranks


def make_instance_endpoints(
    rundir: str,
    instance: int,
    num_workers: int,
    num_detokenizers: int,
    dist_init: str | None = None,
) -> InstanceEndpoints:
    """One instance's endpoints: ipc files in `rundir` (instance 0's without a prefix, as
    a single-instance deployment names them); dist_init: torch.distributed's rendezvous
    (default: a fresh loopback port)."""
    ipc = f"ipc://{rundir}/{f'r{instance}-' if instance else ''}"
    return InstanceEndpoints(
        scheduler_in=f"{ipc}scheduler.ipc",
        worker_plans=[f"{ipc}worker{r}.ipc" for r in range(num_workers)],
        worker_result=f"{ipc}result.ipc",
        detokenizers=[f"{ipc}detok{i}.ipc" for i in range(num_detokenizers)],
        dist_init=dist_init or f"tcp://127.0.0.1:{free_tcp_port()}",
        kv_export=[f"{ipc}kv{r}.ipc" for r in range(num_workers)],
    )


def make_endpoints(
    rundir: str,
    public: str | None,
    num_workers: int,
    num_detokenizers: int,
    dist_init: str | None = None,
    link: str = "",
    num_instances: int = 1,
) -> Endpoints:
    """The deployment's endpoints: ipc files in `rundir` (the public one too unless
    given); dist_init: instance 0's torch.distributed rendezvous (default: a fresh
    loopback port per instance); link: the node link of a multi-node deployment;
    num_instances: engine instances (each with num_workers workers and num_detokenizers
    detokenizers)."""
    ipc = f"ipc://{rundir}"
    return Endpoints(
        public=public or f"{ipc}/public.ipc",
        frontend_in=f"{ipc}/frontend.ipc",
        launcher=f"{ipc}/launcher.ipc",
        instances=[
            make_instance_endpoints(
                rundir, i, num_workers, num_detokenizers, dist_init if i == 0 else None
            )
            for i in range(num_instances)
        ],
        link=link,
        link_control=f"{ipc}/nodelink.ipc" if link else "",
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


#: ipc files of instance 0 (the other instances' carry an "rN-" prefix)
_INSTANCE_FILES = ("scheduler", "worker", "result", "detok", "kv")


def remove_ipc_files(rundir: str, public: str, prefix: str | None = None) -> None:
    """Removes a deployment's ipc files (not the launcher's) and its public one; with
    `prefix`, only one instance's ("rN-", or "" for instance 0, whose files have none)."""
    for name in os.listdir(rundir):
        if not name.endswith(".ipc") or name == "launcher.ipc":
            continue
        if prefix is not None and not (
            name.startswith(prefix) if prefix else name.startswith(_INSTANCE_FILES)
        ):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(rundir, name))
    path = ipc_path(public) if prefix is None else None
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
