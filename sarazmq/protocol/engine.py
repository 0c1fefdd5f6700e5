"""The request pipeline between processes.

frontend -> scheduler (`SchedulerInbound`), scheduler -> detokenizer shards
(`DetokenizerInbound`), scheduler / detokenizers / launcher -> frontend (`FrontendInbound`).
All structs are `array_like`: these sockets are internal and trusted, so the frames are
compact positional arrays.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sarazmq.protocol.client import OutputDelta
from sarazmq.protocol.common import MaybeFinishReason, TokenLogprobs
from sarazmq.sampling_params import SamplingParams

# ---- frontend / detokenizers -> scheduler --------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class StopStringHit(msgspec.Struct, tag="stop_hit", array_like=True):
    """A detokenizer saw a stop string: the scheduler finishes the request and frees it."""

    request_id: str


class StatsQuery(msgspec.Struct, tag="stats", array_like=True):
    request_id: str
    iterations_from: int = -1


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached prefix block; answered with a `StatsAnswer` of
    {"reset": bool, "error": str} (refused while any request holds KV blocks)."""

    request_id: str


class AddPrefilled(msgspec.Struct, tag="add_prefilled", array_like=True):
    """Frontend -> a decode instance (a disaggregated deployment): a request whose prompt
    a prefill instance computed, with its first token. Its KV is pulled from the source
    instance's workers (`KVPull`: the prompt's blocks `source_block_ids`, exported there
    as `source_request_id`) once this instance has blocks for it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    first_token: int
    first_token_time: float
    first_scheduled_time: float
    source_instance: int
    source_request_id: str
    source_block_ids: list[int]


class ReleaseKV(msgspec.Struct, tag="release_kv", array_like=True):
    """Frontend -> a prefill instance: the KV of a handed-off request is no longer needed
    (pulled, or its request is gone): free its blocks."""

    request_id: str


class SourceDown(msgspec.Struct, tag="source_down", array_like=True):
    """Frontend -> every decode instance: prefill instance `instance` died: the requests
    whose KV was to come from it fail now with `reason` (not after a read timeout)."""

    instance: int
    reason: str


SchedulerInbound = (
    AddRequest
    | Abort
    | StopStringHit
    | StatsQuery
    | ResetPrefixCache
    | AddPrefilled
    | ReleaseKV
    | SourceDown
)


# ---- scheduler -> detokenizers -------------------------------------------------------


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, tag="delta"):
    """What one request gained in one iteration (or that it finished), scheduler ->
    detokenizer.

    new_token_ids: tokens sampled this iteration (at most one per iteration; empty for
        an abort or other finish without a token).
    finish_reason: "stop" (EOS / stop token id), "length" (max_tokens or the model
        context), "abort", or "" while the request continues.
    token_times: scheduler clock at which each new token was processed.
    logprobs: per new token, passed through from the worker (empty when the step
        returned no logprobs).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: MaybeFinishReason
    num_prompt_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    token_times: list[float]
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs | None] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason != ""


class DetokenizerAdd(msgspec.Struct, tag="dadd", array_like=True):
    """Sent before any delta of the request, on the same socket (so it arrives first).
    replay_token_ids: output tokens another instance already streamed (a disaggregated
    deployment's first token): fed without emitting, so the text goes on where it left."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    replay_token_ids: list[int] = []


class DetokenizerDrop(msgspec.Struct, tag="ddrop", array_like=True):
    """The request went on to another instance (its first token was handed off): forget
    its state without a final output."""

    request_id: str


class DeltaBatch(msgspec.Struct, tag="deltas", array_like=True):
    """All token deltas of one iteration for one detokenizer shard."""

    deltas: list[RequestDelta]


DetokenizerInbound = DetokenizerAdd | DeltaBatch | DetokenizerDrop


# ---- scheduler / detokenizers -> frontend --------------------------------------------


class OutputBatch(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[OutputDelta]


class StatsAnswer(msgspec.Struct, tag="stats_answer", array_like=True):
    request_id: str
    stats: dict[str, Any]


class HandOff(msgspec.Struct, tag="handoff", array_like=True):
    """A prefill instance -> the frontend: the request's prompt is computed and its first
    token sampled (and streamed); its KV waits in `block_ids` (exported to the instance's
    workers) for a decode instance to pull, from `instance` (the sender). The fields of
    `AddPrefilled`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    first_token: int
    first_token_time: float
    first_scheduled_time: float
    block_ids: list[int]
    instance: int = 0


class KVDone(msgspec.Struct, tag="kv_done", array_like=True):
    """A decode instance -> the frontend: the request's KV arrived (or can no longer be
    pulled): its source prefill instance may free it (`ReleaseKV`)."""

    request_id: str
    source_instance: int
    source_request_id: str


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """From the launcher: a process died; fail every in-flight request with `reason`."""

    reason: str


class Drain(msgspec.Struct, tag="drain", array_like=True):
    """From the launcher (SIGTERM): refuse new requests, let in-flight ones finish for up
    to `timeout` seconds, abort the rest, then answer `Drained`."""

    timeout: float


class NodesStatus(msgspec.Struct, tag="nodes", array_like=True):
    """From the head's node link (multi-node deployments), every second: each node's
    ranks, stages and last heartbeat; merged into every stats reply as "nodes"."""

    nodes: list[dict[str, Any]]


class InstanceLoad(msgspec.Struct, tag="load", array_like=True):
    """From an instance's scheduler to the frontend's router, after its iterations (at most
    every `LOAD_REPORT_INTERVAL_S`) and when asked: how loaded it is now.

    num_added: AddRequests it has received so far (the router counts the ones it sent
        since, which this report does not include yet).
    queued_prefill_tokens: prompt tokens waiting to be computed (waiting requests and
        running ones whose prefill is not done).
    kv_used_blocks / kv_total_blocks: its KV pool (cached prefix blocks count as free).
    """

    instance: int
    num_added: int
    num_waiting: int
    num_running: int
    queued_prefill_tokens: int
    kv_used_blocks: int
    kv_total_blocks: int


class InstanceDown(msgspec.Struct, tag="instance_down", array_like=True):
    """From the launcher: an instance's process died; its requests that have streamed no
    token go to another instance, the others fail with `reason`."""

    instance: int
    reason: str


class InstanceUp(msgspec.Struct, tag="instance_up", array_like=True):
    """From the launcher: an instance (re)started and is ready; it rejoins the rotation."""

    instance: int


FrontendInbound = (
    OutputBatch
    | StatsAnswer
    | EngineDead
    | Drain
    | NodesStatus
    | InstanceLoad
    | InstanceDown
    | InstanceUp
    | HandOff
    | KVDone
)
