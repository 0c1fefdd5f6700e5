"""Serving in simulated time: the real scheduler driven by a latency model.

- `simulator.simulate(requests, scheduler, latency, *, overhead_s=0.0, progress=False,
  exact_prompts=None) -> SimOutcome`: the discrete-event loop around a real `Scheduler`
  (its policy, block manager and prefix cache); `SimOutcome` holds replay's
  `RequestRecord`s and `IterationSample`s (so `summarize` / `write_run` apply), the
  simulated end time `sim_time_s`, the real `wall_s` and `num_iterations`.
  `ReplayLatency(durations)`: a latency model returning given durations in order.
- `run.sim_engine_config(options, *, num_blocks, max_model_len) -> EngineConfig`: the
  engine's own options (`sarazmq.options.EngineOptions`) resolved with the KV pool and
  context the simulator derived; `run.build_sim_scheduler(config)`: its real `Scheduler`
  (`build_scheduler`, on a `SimClock`); `run.simulate_workload(requests, config, latency,
  *, overhead_s=0.0, progress=False) -> SimOutcome`: builds it and runs `simulate`.

Pipeline parallelism: given a `perf.pipeline.PipelineLatency` of pp > 1 stages, `simulate`
runs `pipeline.simulate_pipeline` (up to pp plans in flight, per-stage busy intervals in
`SimOutcome.stage_spans`, the bubble fraction in `SimOutcome.pipeline`);
the config's pipeline_parallel_size gives the scheduler pp plans in flight.

The command-line side (latency source, KV pool size) is `sarazmq.cli.sim_options`.
"""

from sarazmq.sim.run import build_sim_scheduler, sim_engine_config, simulate_workload
from sarazmq.sim.simulator import ReplayLatency, SimClock, SimOutcome, simulate

__all__ = [
    "ReplayLatency",
    "SimClock",
    "SimOutcome",
    "build_sim_scheduler",
    "sim_engine_config",
    "simulate",
    "simulate_workload",
]
