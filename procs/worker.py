"""Worker process (one per rank of tp x pp): plan in, forward (+ sample), result out (driver).

Ranks: global rank = stage * tp + tp_rank (`sarazmq.worker.pipeline.Placement`). With
more than one rank they form one torch.distributed world (gloo on CPU, NCCL on CUDA):
each pipeline stage's ranks a tensor-parallel group for the all-reduces, and stage s's
tp rank r sends its activations to stage s+1's tp rank r point-to-point.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from sarazmq.procs.common import ProcSpec, recv_interruptible, run_process
from sarazmq.procs.sockets import pull_socket, push_socket
from sarazmq.protocol.worker import WorkerInbound
from sarazmq.worker import DistLink, Placement, WorkerService, build_model_runner


def init_distributed(placement: Placement, device: str, init_method: str) -> Any:
    """Joins the world of every worker rank; returns this rank's stage's tensor-parallel
    group (None without tensor parallelism)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(placement.rank % torch.cuda.device_count())
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
    ready(rank=placement.rank, kv_blocks=cfg.cache.num_blocks)
    while not service.stopped:
        result = service.on_message(decoder.decode(recv_interruptible(plans)))
        if result is not None and results is not None:
            results.send(encoder.encode(result))
    if send_to is not None:
        send_to.close()
    if placement.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_process(body)
