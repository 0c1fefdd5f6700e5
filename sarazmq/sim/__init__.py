"""Serving in simulated time: the real scheduler driven by a latency model.

- `simulator.simulate(requests, scheduler, latency, *, overhead_s=0.0, progress=False,
  exact_prompts=None) -> SimOutcome`: the discrete-event loop around a real `Scheduler`
  (its policy, block manager and prefix cache); `SimOutcome` holds replay's
  `RequestRecord`s and `IterationSample`s (so `summarize` / `write_run` apply), the
  simulated end time `sim_time_s`, the real `wall_s` and `num_iterations`.
  `ReplayLatency(durations)`: a latency model returning given durations in order.
- `run.simulate_workload(requests, sched_kw: Mapping, latency, *, block_size: int,
  num_blocks: int, max_model_len: int, seed: int, overhead_s: float = 0.0,
  progress: bool = False) -> SimOutcome`: builds the scheduler from flat options and
  runs `simulate`. sched_kw keys: "scheduler" (policy name; or "policy"), "chunk_size",
  "max_num_seqs", "watermark", "enable_prefix_caching", "tbt_slo", "latency_profile"
  (engine defaults when missing; other keys are ignored, so a command's option dict can
  be passed as is).

Pipeline parallelism: given a `perf.pipeline.PipelineLatency` of pp > 1 stages, `simulate`
runs `pipeline.simulate_pipeline` (up to pp plans in flight, per-stage busy intervals in
`SimOutcome.stage_spans`, the bubble fraction in `SimOutcome.pipeline`);
`simulate_workload` then builds the scheduler with `max_inflight=pp`.

The command-line side (latency source, KV pool size) is `sarazmq.cli.sim_options`.
"""

from sarazmq.sim.run import build_sim_scheduler, simulate_workload
from sarazmq.sim.simulator import ReplayLatency, SimClock, SimOutcome, simulate

__all__ = [
    "ReplayLatency",
    "SimClock",
    "SimOutcome",
    "build_sim_scheduler",
    "simulate",
    "simulate_workload",
]
