"""Worker process (one per tensor-parallel rank): plan in, forward + sample, result out (rank 0)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import zmq

from sarazmq.procs.common import ProcSpec, recv_interruptible, run_process
from sarazmq.procs.sockets import pull_socket, push_socket
from sarazmq.protocol.worker import WorkerInbound
from sarazmq.worker.build import build_model_runner
from sarazmq.worker.service import WorkerService


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    rank = spec.index
    tp = spec.config.tensor_parallel_size
    group = None
    if tp > 1:
        backend = "nccl" if spec.config.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=spec.endpoints.dist_init,
            rank=rank,
            world_size=tp,
            timeout=timedelta(seconds=120),
        )
        group = dist.group.WORLD
    runner = build_model_runner(spec.config, spec.model_config, rank=rank, tp_group=group)
    service = WorkerService(runner, rank)
    plans = pull_socket(ctx, spec.endpoints.worker_plans[rank])
    results = push_socket(ctx, spec.endpoints.worker_result) if service.is_driver else None
    decoder = msgspec.msgpack.Decoder(WorkerInbound)
    encoder = msgspec.msgpack.Encoder()
    ready(rank=rank, kv_blocks=spec.config.cache.num_blocks)
    while not service.stopped:
        result = service.on_message(decoder.decode(recv_interruptible(plans)))
        if result is not None and results is not None:
            results.send(encoder.encode(result))
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_process(body)
