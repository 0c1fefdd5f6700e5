"""Per-request scheduling state (`Request`); it lives only inside the scheduler.

What a request gains each iteration crosses the wire as
`sarazmq.protocol.engine.RequestDelta`.
"""

from __future__ import annotations

import enum

from sarazmq.protocol.common import MaybeFinishReason
from sarazmq.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED; RUNNING -> WAITING on preemption. In a
    disaggregated deployment (`transfers`): on a prefill instance RUNNING -> PARKED (its
    first token out, its KV kept for a decode instance) -> FINISHED once released; on a
    decode instance TRANSFERRING (queued for blocks, or its KV being pulled) -> WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PARKED = "parked"
    TRANSFERRING = "transferring"


class Request:
    """Mutable scheduling state of one request.

    Token bookkeeping (positions are 0-based over `all_token_ids`):
    - `num_computed_tokens`: positions whose KV is in the cache. A request in its
      decode phase has `num_computed_tokens == num_tokens - 1` (the last sampled token
      is not computed yet).
    - `num_prefill_tokens`: how many tokens the current prefill covers: the prompt, or
      prompt + outputs so far after a recompute preemption. Set at (re-)admission.
    - `num_sent_tokens`: how many of `all_token_ids` the workers know (the plan diff
      sends only the rest). 0 while the workers hold no state for this sequence.
    - `num_cached_tokens`: tokens found in the prefix cache at the last admission (the
      prefill starts there).
    - `num_pending_samples`: under asynchronous scheduling (`Scheduler`), tokens sampled
      by plans in flight and not yet in `output_token_ids`; `num_computed_tokens` then
      counts the positions scheduled (its plans' results not all in), so a decode-phase
      request has `num_computed_tokens == num_tokens + num_pending_samples - 1`.

    Prefix-cache bookkeeping (the block manager's): `block_keys` (keys of the full
    blocks hashed so far), `num_keyed_blocks` (leading blocks already keyed or hit),
    `cache_parent` ((block id, generation) the next keyed block chains to).
    """

    __slots__ = (
        "request_id",
        "seq_id",
        "prompt_token_ids",
        "params",
        "seed",
        "max_output_tokens",
        "output_token_ids",
        "num_computed_tokens",
        "num_prefill_tokens",
        "num_sent_tokens",
        "on_worker",
        "block_ids",
        "status",
        "finish_reason",
        "num_preemptions",
        "arrival_time",
        "first_scheduled_time",
        "token_times",
        "num_cached_tokens",
        "block_keys",
        "num_keyed_blocks",
        "cache_parent",
        "finish_token_ids",
        "num_transferred_tokens",
        "num_pending_samples",
    )

    def __init__(
        self,
        request_id: str,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        max_output_tokens: int,
        arrival_time: float,
        finish_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.seq_id = seq_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # params.seed, or a random draw at add time so recomputation after a
        # preemption samples the same tokens
        self.seed = seed
        # params.max_tokens clamped to the model context and the KV pool
        self.max_output_tokens = max_output_tokens
        # sampling one of these finishes it with "stop" (once min_tokens outputs exist):
        # its stop ids and the model's EOS ids (`results.finish_token_ids`)
        self.finish_token_ids = finish_token_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_prefill_tokens = 0
        self.num_sent_tokens = 0
        # whether the workers hold state for seq_id (so it must be in freed_seq_ids)
        self.on_worker = False
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: MaybeFinishReason = ""
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        # iteration-end time of each output token (parallel to output_token_ids)
        self.token_times: list[float] = []
        self.num_cached_tokens = 0
        self.block_keys: list[bytes] = []
        self.num_keyed_blocks = 0
        self.cache_parent: tuple[int, int] | None = None
        # tokens whose KV another instance computed and sent (a disaggregated deployment's
        # decode side): admitted, they count as computed; 0 again after a preemption,
        # whose recompute covers them here
        self.num_transferred_tokens = 0
        self.num_pending_samples = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every known token: prompt + outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next sample (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Running and its (possibly chunked) prefill is not complete yet."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens_from(self, pos: int) -> list[int]:
        """all_token_ids[pos:] without copying the prompt when pos is past it."""
        n = len(self.prompt_token_ids)
        if pos >= n:
            return self.output_token_ids[pos - n :]
        return self.prompt_token_ids[pos:] + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, seq={self.seq_id}, {self.status.value}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
