"""Pipeline parallelism inside one process: every stage's runner, run one after another.

For the in-process engine (`LLMEngine` with pipeline_parallel_size > 1) and tests: the
stages hold the layers exactly as the stage processes of a deployment do and hand their
activations on through `LocalLink`s, so results are the deployment's; there is no
overlap between stages (one process), but the scheduler still keeps up to pp plans in
flight, so its micro-batching is the deployment's too.
"""

from __future__ import annotations

from sarazmq.config import EngineConfig, ModelConfig
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.worker.build import build_model_runner
from sarazmq.worker.model_runner import ModelRunner
from sarazmq.worker.pipeline import LocalLink


class InProcessPipeline:
    """One runner per pipeline stage (tensor parallel size 1), linked in order.

    `execute(plan)` runs the plan through every stage and returns the last stage's
    result (with every stage's timings), as the driver of a deployment would.
    """

    def __init__(self, runners: list[ModelRunner]) -> None:
        if not runners:
            raise ValueError("a pipeline needs at least one stage")
        self.runners = runners

    @property
    def num_stages(self) -> int:
        return len(self.runners)

    def execute(self, plan: BatchPlan) -> StepResult:
        """Every stage runs `plan` in stage order; the last stage's result."""
        result = StepResult(step=plan.step)
        for runner in self.runners:
            result = runner.execute(plan)
        return result


def build_in_process_pipeline(config: EngineConfig, model_config: ModelConfig) -> InProcessPipeline:
    """Every stage of `config.pipeline_parallel_size` in this process, each loading only
    its layers. ValueError with tensor parallelism (one process runs one tp rank)."""
    if config.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size}: an in-process pipeline runs "
            "tp=1; use `sarazmq serve --tp N --pp M`"
        )
    pp = config.pipeline_parallel_size
    links = [LocalLink() for _ in range(pp - 1)]
    runners = [
        build_model_runner(
            config,
            model_config,
            rank=stage,
            recv_from=links[stage - 1] if stage > 0 else None,
            send_to=links[stage] if stage < pp - 1 else None,
        )
        for stage in range(pp)
    ]
    return InProcessPipeline(runners)
