"""The worker process's room (one per tensor-parallel rank).

- `service.WorkerService`: one scheduler message in, the driver's `StepResult` out.
- `model_runner.ModelRunner`: applies a plan's diff, runs the hybrid batch, samples.
- `build.build_model_runner`: the one way to build a rank's runner (model shard, KV
  cache, sampler) from a resolved config, in-process or in a worker process.
- `sampler.Sampler`: seeded sampling, penalties, logprobs (rank 0 only).

The process loop is `sarazmq.procs.worker`.
"""
