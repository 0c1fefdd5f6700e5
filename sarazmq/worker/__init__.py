"""The worker process's room (one per tensor-parallel rank).

- `service.WorkerService`: one scheduler message in, the driver's `StepResult` out.
- `model_runner.ModelRunner`: applies a plan's diff, runs the hybrid batch, samples.
- `build.build_model_runner`: the one way to build a rank's runner (model shard, KV
  cache, sampler) from a resolved config, in-process or in a worker process.
- `sampler.Sampler`: seeded sampling, penalties, logprobs (rank 0 only).
- `kv_transfer`: a disaggregated deployment's KV blocks between instances
  (`KVExporter` on a prefill instance's workers, `KVImporter` on a decode instance's).

The process loop is `sarazmq.procs.worker`.
"""

from sarazmq.worker.build import build_model_runner
from sarazmq.worker.inprocess import InProcessPipeline, build_in_process_pipeline
from sarazmq.worker.kv_transfer import KVExporter, KVImporter
from sarazmq.worker.model_runner import ModelRunner
from sarazmq.worker.pipeline import DistLink, Placement
from sarazmq.worker.service import WorkerService

__all__ = [
    "DistLink",
    "InProcessPipeline",
    "KVExporter",
    "KVImporter",
    "ModelRunner",
    "Placement",
    "WorkerService",
    "build_in_process_pipeline",
    "build_model_runner",
]
