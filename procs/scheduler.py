"""Scheduler process: control in, BatchPlans out to every worker, deltas out.

Up to `pipeline_parallel_size` plans are in flight (one per stage); the last stage's
driver answers them in order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import msgspec
import zmq

from sarazmq.procs.common import ProcSpec, run_process
from sarazmq.procs.sockets import pull_socket, push_socket
from sarazmq.protocol.engine import SchedulerInbound
from sarazmq.protocol.worker import KVPulled, Shutdown, WorkerOutbound
from sarazmq.scheduler import (
    SchedulerActions,
    SchedulerService,
    build_scheduler,
    configure_scheduler_gc,
)

#: the most often an instance reports its load to the router (seconds)
LOAD_REPORT_INTERVAL_S = 0.02


def body(spec: ProcSpec, ctx: zmq.Context, ready: Callable[..., None]) -> None:
    cfg = spec.config
    scheduler = build_scheduler(cfg, spec.model_config.eos_token_ids, instance=spec.instance)
    service = SchedulerService(scheduler, spec.deployment.num_detokenizers, spec.instance)
    # several instances: the frontend's router needs this one's load (`InstanceLoad`)
    report_load = cfg.num_instances > 1
    last_report: tuple[float, ...] = (0.0, -1, -1, -1, -1)  # (when, *state) last reported
    inbound = pull_socket(ctx, spec.own.scheduler_in)
    results = pull_socket(ctx, spec.own.worker_result)
    workers = [push_socket(ctx, ep) for ep in spec.own.worker_plans]
    detoks = [push_socket(ctx, ep) for ep in spec.own.detokenizers]
    frontend = push_socket(ctx, spec.endpoints.frontend_in)
    in_decoder = msgspec.msgpack.Decoder(SchedulerInbound)
    result_decoder = msgspec.msgpack.Decoder(WorkerOutbound)
    enc = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(inbound, zmq.POLLIN)
    poller.register(results, zmq.POLLIN)
    configure_scheduler_gc()
    ready(num_blocks=cfg.cache.num_blocks)

    def flush(acts: SchedulerActions) -> None:
        for shard, msgs in acts.to_detokenizers.items():
            for m in msgs:
                detoks[shard].send(enc.encode(m))
        for m in acts.to_frontend:
            frontend.send(enc.encode(m))

    # schedule() returns None while requests are unfinished when none can run (e.g. the
    # pool is too full to admit any): only an inbound message (abort, stop string, new
    # request) or a result can change that, so wait for one instead of spinning.
    stalled = False
    try:
        while True:
            want_plan = service.can_plan and scheduler.has_unfinished() and not stalled
            events = dict(poller.poll(0 if want_plan else 200))
            acts = SchedulerActions()
            if inbound in events:
                stalled = False
                # drain everything that is queued, without blocking the iteration
                while True:
                    try:
                        frame = inbound.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    service.on_inbound(in_decoder.decode(frame), acts)
            if results in events:
                stalled = False
                # step results (the driver's) and KV pull reports (every rank's)
                while True:
                    try:
                        frame = results.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    out = result_decoder.decode(frame)
                    if isinstance(out, KVPulled):
                        service.on_kv_pulled(out, acts)
                    else:
                        service.on_result(out, acts)
            # the KV exports, releases and pulls come before any later plan
            for msg in acts.to_workers:
                frame = enc.encode(msg)
                for w in workers:
                    w.send(frame)
            # fill the pipeline: one plan per free slot (a request is in at most one)
            while service.can_plan and scheduler.has_unfinished() and not stalled:
                plan = service.next_plan()
                if plan is None:
                    stalled = True
                else:
                    frame = enc.encode(plan)
                    for w in workers:
                        w.send(frame)
            flush(acts)
            if report_load:
                now = time.monotonic()
                # aborts change the queues without an iteration or an addition
                state = (
                    service.num_added,
                    scheduler.num_iterations,
                    len(scheduler.waiting),
                    len(scheduler.running),
                )
                if state != last_report[1:] and now - last_report[0] >= LOAD_REPORT_INTERVAL_S:
                    frontend.send(enc.encode(service.load()))
                    last_report = (now, *state)
    finally:
        for w in workers:
            with contextlib.suppress(zmq.ZMQError):
                w.send(enc.encode(Shutdown(reason="scheduler exiting")), zmq.NOBLOCK)


if __name__ == "__main__":
    run_process(body)
