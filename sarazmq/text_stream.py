"""Turning scheduler token deltas into client-facing text deltas (shared by every detokenizer)."""

from __future__ import annotations

from collections.abc import Iterable

from sarazmq.detokenizer import DetokenizerManager
from sarazmq.protocol import OutputDelta
from sarazmq.scheduler import RequestDelta


def text_outputs(
    manager: DetokenizerManager, deltas: Iterable[RequestDelta]
) -> tuple[list[OutputDelta], list[str]]:
    """Detokenizes a batch of deltas.

    Returns the client-facing deltas and the ids of requests that a stop string just
    ended (the scheduler must be told, so they stop computing and free their blocks).
    """
    outputs: list[OutputDelta] = []
    stop_hits: list[str] = []
    for d in deltas:
        text = manager.process(d)
        if text.stop_string_hit and not d.finish_reason:
            stop_hits.append(d.request_id)
        outputs.append(
            OutputDelta(
                request_id=d.request_id,
                text=text.text,
                token_ids=list(d.new_token_ids),
                finish_reason=text.finish_reason,
                arrival_time=d.arrival_time,
                first_scheduled_time=d.first_scheduled_time or 0.0,
                token_times=list(d.token_times),
                logprobs=list(d.logprobs),
                num_preemptions=d.num_preemptions,
            )
        )
    return outputs, stop_hits
