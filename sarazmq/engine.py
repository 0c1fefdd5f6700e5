"""The in-process engine (offline use and tests) and the `LLM` API on top of it.

`LLMEngine` composes the same socket-free classes the deployment runs in separate
processes, built by the same functions: `PromptTokenizer` (frontend), `Scheduler`
(`build_scheduler`), `ModelRunner` (worker rank 0, `build_model_runner`) and
`DetokenizerService`. One `step()` is one iteration: plan, execute, update, detokenize.

With pipeline_parallel_size > 1 every stage runs in this process, one after another
(`InProcessPipeline`): the same results and the same micro-batching (up to pp plans in
flight, a request in at most one) as a deployment, without the stages' overlap.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from sarazmq.config import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    EngineConfig,
    SchedulerConfig,
)
from sarazmq.detokenizer import DetokenizerService
from sarazmq.frontend import PromptTokenizer
from sarazmq.model.loader import load_tokenizer, resolve_model
from sarazmq.options import EngineOptions
from sarazmq.outputs import RequestOutput
from sarazmq.protocol.common import FINISH_ERROR
from sarazmq.protocol.worker import StepResult
from sarazmq.resolve import describe_dtype, resolve_engine_config
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import build_scheduler
from sarazmq.validation import InvalidRequestError
from sarazmq.worker import (
    InProcessPipeline,
    ModelRunner,
    build_in_process_pipeline,
    build_model_runner,
)

log = logging.getLogger("sarazmq.engine")

Prompt = str | Sequence[int]


class LLMEngine:
    """Single-process engine: one model runner, the scheduler, detokenization, in one loop."""

    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size}: the in-process engine "
                "runs tp=1; use `sarazmq serve --tp N`"
            )
        if config.num_instances != 1:
            raise ValueError(
                f"{config.num_instances} engine instances (data_parallel_size="
                f"{config.data_parallel_size}, prefill/decode {config.prefill_instances}/"
                f"{config.decode_instances}): the in-process engine is one; use `sarazmq serve`"
            )
        self.config, self.model_config = resolve_engine_config(config)
        log.info("engine: %s", describe_dtype(config, self.config))
        tokenizer = load_tokenizer(resolve_model(self.config.model, self.config.load_format))
        self.tokenizer = PromptTokenizer(
            tokenizer, self.model_config.vocab_size, self.config.scheduler.max_model_len
        )
        self.runner: ModelRunner | InProcessPipeline = (
            build_model_runner(self.config, self.model_config)
            if self.config.pipeline_parallel_size == 1
            else build_in_process_pipeline(self.config, self.model_config)
        )
        # results of plans still "in flight" (pipeline parallel: up to pp), oldest first
        self._results: deque[StepResult] = deque()
        self.scheduler = build_scheduler(self.config, self.model_config.eos_token_ids)
        self.detokenizer = DetokenizerService(tokenizer)
        self.outputs: dict[str, RequestOutput] = {}

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queues a request; raises InvalidRequestError (naming the field) for bad input."""
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenizer.encode(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.scheduler.add_request(request_id, ids, params, arrival_time=arrival)
        self.detokenizer.add(request_id, ids, params)
        self.outputs[request_id] = RequestOutput(
            request_id=request_id, prompt_token_ids=ids, arrival_time=arrival
        )

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def replace_scheduler(self, config: SchedulerConfig, num_blocks: int | None = None) -> None:
        """Switches policy/budget on an idle engine, keeping the loaded model and KV cache.

        num_blocks: use only this many of the allocated KV blocks (to study a smaller
        pool without reloading). Used to compare policies on one loaded model.
        """
        if self.scheduler.has_unfinished() or self._results:
            raise RuntimeError("cannot replace the scheduler while requests are unfinished")
        if config.max_model_len != self.config.scheduler.max_model_len:
            config = dataclasses.replace(config, max_model_len=self.config.scheduler.max_model_len)
        allocated = self.config.cache.num_blocks
        if num_blocks is not None and not 1 <= num_blocks <= allocated:
            raise ValueError(f"num_blocks={num_blocks} must be in [1, {allocated}] (allocated)")
        self.scheduler = build_scheduler(
            self.config,
            self.model_config.eos_token_ids,
            num_blocks=num_blocks,
            scheduler_config=config,
        )

    def has_unfinished(self) -> bool:
        """Requests left, or results of plans in flight not processed yet."""
        return self.scheduler.has_unfinished() or bool(self._results)

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests that changed."""
        deltas = list(self.scheduler.drain_finished())
        # fill the pipeline (one plan, or two with asynchronous scheduling) and take the
        # oldest result, as a deployment's scheduler does. The forward runs here, inside
        # the call, so a result waiting when the next plan is built is processed before
        # that plan runs: each iteration record then times its own forward.
        processed = False
        while self.scheduler.can_schedule():
            plan = self.scheduler.schedule()
            if plan is None:
                break
            if self._results:
                deltas.extend(self.scheduler.process_result(self._results.popleft()))
                processed = True
            self._results.append(self.runner.execute(plan))
            if processed:
                break
        if self._results and not processed:
            deltas.extend(self.scheduler.process_result(self._results.popleft()))
        result = self.detokenizer.detokenize(deltas)
        for rid in result.stop_hits:
            self.scheduler.finish_by_stop_string(rid)
        changed: list[RequestOutput] = []
        for delta in result.outputs:
            out = self.outputs.get(delta.request_id)
            if out is None:
                continue
            out.apply(delta)
            changed.append(out)
            if out.finished:
                del self.outputs[delta.request_id]
        return changed


class LLM:
    """Offline generation: `LLM(model=...).generate(prompts, params)`.

    All prompts of one call are admitted together, so their prefill chunks and
    decodes share iterations exactly as in serving.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        scheduler: str = "sarathi",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        dtype: str = "auto",
        **options: Any,
    ) -> None:
        """options: any other field of `sarazmq.options.EngineOptions` (block_size,
        num_kv_blocks, max_model_len, seed, enable_prefix_caching, tbt_slo, ...); an
        unknown one is a TypeError naming it."""
        config = EngineOptions(
            model=model,
            scheduler=scheduler,
            chunk_size=chunk_size,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            **options,
        ).to_config()
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order.

        A prompt that is invalid on its own (empty, too long, bad token ids) gets an
        output with finish_reason="error" and `error` naming the problem; the other
        prompts of the call run normally.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run(list(prompts), params)  # type: ignore[arg-type]

    def chat(
        self,
        conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation and generates the reply."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        items: list[Prompt | InvalidRequestError] = []
        for conv in conversations:
            try:
                items.append(self.engine.tokenizer.apply_chat_template(conv))  # type: ignore[arg-type]
            except InvalidRequestError as e:
                items.append(e)
        return self._run(items, params)

    def _run(
        self,
        items: Sequence[Prompt | InvalidRequestError],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        """Admits every item together (an InvalidRequestError item, or one add_request
        rejects, becomes an error output) and steps until all are finished."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_request = [params] * len(items)
        else:
            per_request = list(params)
            if len(per_request) != len(items):
                raise ValueError(f"got {len(per_request)} SamplingParams for {len(items)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for item, p in zip(items, per_request):
            rid = f"offline-{next(self._ids)}"
            order.append(rid)
            try:
                if isinstance(item, InvalidRequestError):
                    raise item
                self.engine.add_request(rid, item, p)
            except InvalidRequestError as e:
                results[rid] = RequestOutput(
                    request_id=rid, finish_reason=FINISH_ERROR, error=e.message, error_field=e.field
                )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in order]
