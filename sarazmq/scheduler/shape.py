"""The shape of one hybrid iteration: what its time depends on.

An iteration runs prefill chunks and decodes together. Its time is driven by
- the tokens through the linear layers (every prefill token and every decode),
- prefill attention: (query, key) pairs inside the causal mask of each chunk,
- decode attention: the KV tokens every decode reads,
- the rows through the LM head (one per sampling sequence),
- per-sequence overheads (metadata, sampling).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sarazmq.protocol.worker import BatchPlan


class IterationShape(msgspec.Struct, frozen=True, array_like=True):
    """Features of one iteration.

    num_prefill_tokens: tokens of the prefill chunks.
    num_prefill_seqs: prefill chunks (sequences with a chunk this iteration).
    prefill_attention_pairs: (query, key) pairs the chunks' causal attention computes:
        for a chunk of q tokens after `start` computed ones, q * start + q * (q + 1) / 2.
    num_decode_seqs: decodes (one token each).
    decode_context_tokens: KV positions the decodes read, summed (each decode at
        position p reads p + 1).
    num_sampled: rows through the LM head (decodes plus prefills that finish).
    """

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_attention_pairs: int = 0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    num_sampled: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens through the linear layers."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs


SHAPE_FIELDS: tuple[str, ...] = IterationShape.__struct_fields__


def shape_of_fields(record: object) -> IterationShape:
    """The shape held in any record with attributes named as IterationShape's fields
    (the scheduler's IterationRecord, replay's IterationSample)."""
    return IterationShape(**{f: getattr(record, f) for f in SHAPE_FIELDS})


def chunk_attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of a causal chunk of `num_tokens` after `start` computed ones."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def shape_of(
    prefills: Iterable[tuple[int, int, bool]], decode_positions: Iterable[int]
) -> IterationShape:
    """The shape of an iteration with prefill chunks (start, num_tokens, samples) and
    decodes at these positions (the decode computes position p, reading p + 1 keys)."""
    n_pt = n_ps = pairs = n_sampled = 0
    for start, n, sample in prefills:
        n_pt += n
        n_ps += 1
        pairs += chunk_attention_pairs(start, n)
        n_sampled += int(sample)
    n_d = ctx = 0
    for pos in decode_positions:
        n_d += 1
        ctx += pos + 1
    return IterationShape(
        num_prefill_tokens=n_pt,
        num_prefill_seqs=n_ps,
        prefill_attention_pairs=pairs,
        num_decode_seqs=n_d,
        decode_context_tokens=ctx,
        num_sampled=n_sampled + n_d,
    )


def shape_of_plan(plan: BatchPlan, num_decodes: int) -> IterationShape:
    """The shape of a plan whose first `num_decodes` scheduled entries are decodes (the
    scheduler lists decodes first, then prefill chunks)."""
    sched = plan.scheduled
    return shape_of(
        ((s.start_pos, s.num_tokens, s.sample) for s in sched[num_decodes:]),
        (s.start_pos for s in sched[:num_decodes]),
    )
