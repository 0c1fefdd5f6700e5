"""Worker process (one per rank of tp x pp): plan in, forward (+ sample), result out (driver).

Ranks: global rank = stage * tp + tp_rank (`sarazmq.worker.pipeline.Placement`). With
more than one rank they form one torch.distributed world (gloo on CPU, NCCL on CUDA):
each pipeline stage's ranks a tensor-parallel group for the all-reduces, and stage s's
tp rank r sends its activations to stage s+1's tp rank r point-to-point.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from sarazmq.procs.common import ProcSpec, recv_interruptible, run_process
from sarazmq.procs.sockets import pull_socket, push_socket
from sarazmq.protocol.worker import KVExport, KVPull, KVPulled, KVRelease, WorkerInbound
from sarazmq.worker import (
    DistLink,
    KVExporter,
    KVImporter,
    Placement,
    WorkerService,
    build_model_runner,
)

log = logging.getLogger("sarazmq.worker")


def device_index(spec: ProcSpec, rank: int) -> int:
    """The local device of an instance's rank: instances on a node take consecutive
    blocks of tp x pp devices (the node's first instance the first block)."""
    cfg, dep = spec.config, spec.deployment
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    per_node = cfg.num_instances // dep.nnodes if cfg.num_instances > 1 else 1
    local = spec.instance % max(1, per_node)
    return local * world + rank


def init_distributed(placement: Placement, device: str, init_method: str) -> Any:
    """Joins the world of every worker rank; returns this rank's stage's tensor-parallel
    group (None without tensor parallelism)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=placement.rank,
        world_size=placement.world_size,
        timeout=timedelta(seconds=120),
    )
    if placement.tp_size == 1:
        return None
    if placement.pp_size == 1:
        return dist.group.WORLD
    group = None
    # every rank creates every stage's group, in the same order (new_group's contract)
    for stage in range(placement.pp_size):
        g = dist.new_group(ranks=placement.stage_ranks(stage))
        if stage == placement.pp_rank:
            group = g
    return group


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    cfg = spec.config
    placement = Placement(spec.index, cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
    if cfg.device.startswith("cuda"):
        # each engine instance on this node has devices of its own
        torch.cuda.set_device(device_index(spec, placement.rank) % torch.cuda.device_count())
    group = None
    if placement.world_size > 1:
        group = init_distributed(placement, cfg.device, spec.own.dist_init)
    device = torch.device(cfg.device)
    recv_from = send_to = None
    if placement.pp_size > 1:
        link = DistLink(placement.prev_rank, placement.next_rank, device)
        recv_from = link if placement.prev_rank is not None else None
        send_to = link if placement.next_rank is not None else None
    runner = build_model_runner(
        cfg,
        spec.model_config,
        rank=placement.rank,
        tp_group=group,
        recv_from=recv_from,
        send_to=send_to,
    )
    service = WorkerService(runner, placement.rank)
    plans = pull_socket(ctx, spec.own.worker_plans[placement.rank])
    results = push_socket(ctx, spec.own.worker_result) if service.is_driver else None
    decoder = msgspec.msgpack.Decoder(WorkerInbound)
    encoder = msgspec.msgpack.Encoder()
    kv = KVEnds(ctx, spec, placement.rank, runner.kv_caches)
    ready(rank=placement.rank, kv_blocks=cfg.cache.num_blocks)
    while not service.stopped:
        msg = decoder.decode(recv_interruptible(plans))
        if isinstance(msg, (KVExport, KVRelease, KVPull)):
            kv.on_message(msg)
            continue
        result = service.on_message(msg)
        if result is not None and results is not None:
            results.send(encoder.encode(result))
    kv.close()
    if send_to is not None:
        send_to.close()
    if placement.world_size > 1:
        dist.destroy_process_group()


class KVEnds:
    """A worker's ends of a disaggregated deployment's KV transfers (none when
    co-located): a prefill instance's exporter, a decode instance's importer, which
    reports each pull to the scheduler (`KVPulled`) on a socket of its own thread."""

    def __init__(self, ctx: zmq.Context, spec: ProcSpec, rank: int, caches: Any) -> None:
        self.spec, self.rank = spec, rank
        role = spec.config.instance_role(spec.instance)
        self.exporter = (
            KVExporter(ctx, spec.own.kv_export[rank], caches) if role == "prefill" else None
        )
        self.importer = KVImporter(ctx, caches, self._report) if role == "decode" else None
        self._ctx = ctx
        self._local = threading.local()

    def _report(self, seq_id: int, error: str, nbytes: int, seconds: float) -> None:
        # called on the importer's thread: a socket of that thread
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = push_socket(self._ctx, self.spec.own.worker_result)
        sock.send(msgspec.msgpack.encode(KVPulled(seq_id, self.rank, error, nbytes, seconds)))

    def on_message(self, msg: KVExport | KVRelease | KVPull) -> None:
        if isinstance(msg, KVPull):
            if self.importer is None:
                log.error("a KV pull reached a worker that is not a decode instance's")
                return
            source = self.spec.endpoints.instances[msg.source_instance].kv_export[self.rank]
            self.importer.pull(
                msg.seq_id, source, msg.source_request_id, msg.source_block_ids, msg.block_ids
            )
        elif self.exporter is None:
            log.error("a KV export reached a worker that is not a prefill instance's")
        elif isinstance(msg, KVExport):
            self.exporter.register(msg.request_id, msg.block_ids)
        else:
            self.exporter.release(msg.request_id)

    def close(self) -> None:
        for end in (self.exporter, self.importer):
            if end is not None:
                end.close()


if __name__ == "__main__":
    run_process(body)
