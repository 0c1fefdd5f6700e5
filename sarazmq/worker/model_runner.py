"""Worker-side execution of a `BatchPlan`: per-sequence state, input tensors, forward, sampling.

The runner is socket-free: the in-process engine calls `execute` directly and the
worker process wraps it in a receive/send loop. Each tensor-parallel rank has its own
runner over its own model shard and KV cache; only the driver (tp rank 0 of the last
pipeline stage) samples. Every pipeline stage applies every plan's diff (positions and
block tables); a stage after the first takes its input activations from the previous
stage and a stage before the last hands its own on (`sarazmq.worker.pipeline`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.protocol.common import TokenLogprobs
from sarazmq.protocol.worker import BatchPlan, StepResult
from sarazmq.sampling_params import SamplingParams
from sarazmq.worker.cuda_graphs import DecodeGraphs
from sarazmq.worker.pipeline import StageLinks, new_timings
from sarazmq.worker.sampler import Sampler, SamplingSeq


class PlanError(RuntimeError):
    """A plan disagrees with the worker's view of a sequence (a scheduler/worker bug)."""


@dataclass
class SeqState:
    """What a worker remembers about one sequence between iterations."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class ModelRunner:
    """Runs one forward pass per plan over the hybrid batch it describes."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler | None,
        device: torch.device,
        stage: StageLinks | None = None,
        decode_graphs: DecodeGraphs | None = None,
        keep_sampled_tokens: bool = False,
    ) -> None:
        """stage: this runner's pipeline stage and its activation links (None: the
        whole model, no pipeline); decode_graphs: where decode-only batches it takes run
        (captured CUDA graphs), None: every batch runs op by op; keep_sampled_tokens:
        append each sampled token to its sequence here (asynchronous scheduling: the
        next plan, built before this result is in, decodes from it; see
        `sarazmq.scheduler.inflight`); needs a sampler (the only worker)."""
        if keep_sampled_tokens and sampler is None:
            raise ValueError("keep_sampled_tokens needs the runner that samples")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        # None on non-driver ranks: they compute but never sample
        self.sampler = sampler
        self.device = device
        self.stage = stage
        self.decode_graphs = decode_graphs
        self.keep_sampled_tokens = keep_sampled_tokens
        self._seqs: dict[int, SeqState] = {}
        # float32 logits destination reused across steps (see LlamaForCausalLM.compute_logits)
        self._logits_buf: torch.Tensor | None = None

    def execute(self, plan: BatchPlan) -> StepResult:
        """Applies the plan's diff to the sequence states, runs the batch, samples."""
        t0 = time.perf_counter()
        for seq_id in plan.freed_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self._seqs[new.seq_id] = SeqState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                num_computed=new.num_cached_tokens,  # prefix-cache hit: KV already there
            )
        if not plan.scheduled:
            return StepResult(step=plan.step)

        # Decodes (one token) first, so the attention backend can batch them.
        order = sorted(range(len(plan.scheduled)), key=lambda i: plan.scheduled[i].num_tokens != 1)
        input_ids: list[int] = []
        q_lens: list[int] = []
        k_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # row in the packed batch whose logits are sampled
        sample_seq_ids: list[int] = []
        # per sequence only: token ids are copied slice-wise, positions and cache slots
        # are computed with tensor ops in AttentionMetadata.build
        for i in order:
            item = plan.scheduled[i]
            state = self._seqs.get(item.seq_id)
            if state is None:
                raise PlanError(f"step {plan.step}: unknown seq_id {item.seq_id}")
            if item.start_pos != state.num_computed:
                raise PlanError(
                    f"step {plan.step}: seq {item.seq_id} start_pos {item.start_pos} != "
                    f"computed {state.num_computed}"
                )
            if item.append_token_ids:
                state.token_ids.extend(item.append_token_ids)
            if item.new_block_ids:
                state.block_ids.extend(item.new_block_ids)
            end = item.start_pos + item.num_tokens
            if end > len(state.token_ids):
                raise PlanError(
                    f"step {plan.step}: seq {item.seq_id} asks for positions up to {end} but "
                    f"only {len(state.token_ids)} tokens are known"
                )
            if item.num_tokens == 1:
                input_ids.append(state.token_ids[item.start_pos])
            else:
                input_ids.extend(state.token_ids[item.start_pos : end])
            q_lens.append(item.num_tokens)
            k_lens.append(end)
            tables.append(state.block_ids)
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_seq_ids.append(item.seq_id)
            state.num_computed = end

        graphs = self.decode_graphs
        if (
            graphs is not None
            and len(input_ids) == len(q_lens)  # decodes only
            and graphs.takes(len(q_lens), max(len(t) for t in tables))
        ):
            with torch.inference_mode():
                hidden = graphs.run(input_ids, k_lens, tables)  # [B, hidden]
                return self._sample(plan.step, t0, hidden, sample_rows, sample_seq_ids)
        meta = AttentionMetadata.build(q_lens, k_lens, tables, self.block_size, self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        pos_t = meta.positions  # [T]
        stage = self.stage
        inputs = timings = None
        wait_s = 0.0
        with torch.inference_mode():
            if stage is not None:
                pp = stage.placement.pp_size
                if stage.recv_from is not None:
                    t_wait = time.perf_counter()
                    inputs, timings = stage.recv_from.recv(
                        self.model.activation_shape(len(input_ids)), self.model_dtype, (2, pp)
                    )
                    wait_s = time.perf_counter() - t_wait
                else:
                    timings = new_timings(pp, self.device)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta, inputs)  # [T, hidden]
            if stage is not None and timings is not None and stage.send_to is not None:
                busy_s = time.perf_counter() - t0 - wait_s
                timings[0, stage.placement.pp_rank] = busy_s
                timings[1, stage.placement.pp_rank] = wait_s
                stage.send_to.send(hidden, timings)
                return StepResult(step=plan.step, forward_s=busy_s)
            return self._sample(plan.step, t0, hidden, sample_rows, sample_seq_ids, wait_s, timings)

    def _sample(
        self,
        step: int,
        t0: float,
        hidden: torch.Tensor,
        sample_rows: list[int],
        sample_seq_ids: list[int],
        wait_s: float = 0.0,
        timings: torch.Tensor | None = None,
    ) -> StepResult:
        """Samples the next token of the sequences whose rows of hidden [T, hidden] are
        `sample_rows` (on the driver; elsewhere nothing) and makes the step's result."""
        if self.sampler is None or not sample_rows:
            return self._result(step, t0, wait_s, timings, [], [], [])
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(
            hidden.index_select(0, rows), self._logits_out(len(sample_rows))
        )  # [N, vocab]
        states = [self._seqs[s] for s in sample_seq_ids]
        token_ids, logprobs = self.sampler.sample(logits, [self._sampling_seq(s) for s in states])
        if self.keep_sampled_tokens:
            for state, token in zip(states, token_ids, strict=True):
                state.token_ids.append(token)
        return self._result(step, t0, wait_s, timings, sample_seq_ids, token_ids, logprobs)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of the model's activations (its norm weights')."""
        return self.model.layers[0].input_layernorm.dtype

    def _result(
        self,
        step: int,
        t0: float,
        wait_s: float,
        timings: torch.Tensor | None,
        seq_ids: list[int],
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
    ) -> StepResult:
        """The step's result; on the last pipeline stage with every stage's timings."""
        forward_s = time.perf_counter() - t0
        busy: list[float] = []
        waits: list[float] = []
        if timings is not None and self.stage is not None:
            rank = self.stage.placement.pp_rank
            times = timings.cpu().tolist()
            busy, waits = times[0], times[1]
            busy[rank], waits[rank] = forward_s - wait_s, wait_s
        return StepResult(
            step=step,
            seq_ids=seq_ids,
            token_ids=token_ids,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else [],
            forward_s=forward_s,
            stage_busy_s=busy,
            stage_wait_s=waits,
        )

    def sequence_ids(self) -> list[int]:
        """Ids of the sequences this runner holds state for, in arrival order."""
        return list(self._seqs)

    def sequence(self, seq_id: int) -> SeqState:
        """The state this runner holds for `seq_id` (read it, do not change it: the plans
        do; benchmarks use `assume_computed`). KeyError for an unknown id."""
        return self._seqs[seq_id]

    def assume_computed(self, seq_id: int, num_computed: int, block_ids: list[int]) -> None:
        """Declares a sequence's first `num_computed` positions computed, their KV in
        `block_ids` (its whole block table), whatever the cache holds there: for
        benchmarks that time steps at a long context without prefilling it first.
        ValueError for an unknown id, a count outside its tokens or too few blocks."""
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"assume_computed: unknown seq_id {seq_id}")
        if not 0 <= num_computed <= len(state.token_ids):
            raise ValueError(
                f"assume_computed: num_computed={num_computed} outside the sequence's "
                f"{len(state.token_ids)} tokens"
            )
        if len(block_ids) * self.block_size < num_computed:
            raise ValueError(
                f"assume_computed: {len(block_ids)} blocks of {self.block_size} tokens cannot "
                f"hold {num_computed} positions"
            )
        state.block_ids = list(block_ids)
        state.num_computed = num_computed

    def _logits_out(self, rows: int) -> torch.Tensor:
        """A float32 [rows, vocab] view of the reused logits buffer (grown as needed)."""
        vocab = self.model.config.vocab_size
        buf = self._logits_buf
        if buf is None or buf.numel() < rows * vocab:
            buf = torch.empty(rows * vocab, dtype=torch.float32, device=self.device)
            self._logits_buf = buf
        return buf[: rows * vocab].view(rows, vocab)

    @staticmethod
    def _sampling_seq(state: SeqState) -> SamplingSeq:
        return SamplingSeq(
            params=state.params,
            seed=state.seed,
            output_index=len(state.token_ids) - state.num_prompt_tokens,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
            output_token_ids=state.token_ids[state.num_prompt_tokens :],
        )
