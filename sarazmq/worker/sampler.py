"""Token sampling on the driver worker: penalties, min_tokens, greedy/temperature/top-k/top-p/min-p.

Order of operations (vLLM / Hugging Face semantics), per row of the logits:

1. penalties on the raw logits: repetition (HF: every token seen in prompt or output has a
   positive logit divided by the penalty, a negative one multiplied), then presence and
   frequency (OpenAI: over output tokens only, `l -= frequency * count + presence * [count>0]`);
2. log-probabilities, if requested, are `log_softmax` of these penalized logits: before
   min_tokens masking and before temperature/filtering, so they describe the model (plus
   the penalties the user asked for) rather than the sampling knobs, and stay comparable
   across temperatures;
3. min_tokens: EOS and `stop_token_ids` are masked to -inf while `output_index < min_tokens`;
4. greedy (`temperature == 0`): argmax, lowest index on ties;
5. otherwise temperature, then top-k, top-p and min-p filtering, then one random draw.

Reproducibility: the draw uses the "exponential race": with `q_i ~ Exp(1)` i.i.d.,
`argmax_i p_i / q_i` is distributed as Categorical(p). The noise `q` of a row comes from a
`torch.Generator` seeded with a hash of (seed, output_index) alone, and the race is done in
log space (`argmax_i l_i - log q_i`, with no softmax normalisation in the way), so a row's
token depends only on its seed, its output index and its own filtered logits: not on which
other sequences share the batch, their order, or whether the sequence was preempted and
recomputed. (Noise streams differ between CPU and CUDA generators, so a seed reproduces a
sample on the same kind of device.)
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sarazmq.kernels.argmax import argmax_rows
from sarazmq.protocol.common import TokenLogprobs
from sarazmq.sampling_params import SamplingParams

# q ~ Exp(1) may be exactly 0 (u == 0 in -log(1 - u)); clamping keeps -log(q) finite so a
# masked token (-inf) can never turn into NaN (-inf + inf) and win the argmax.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingSeq:
    """What the worker knows about one sequence being sampled this step.

    output_index: index of the output token being drawn (0 for the first); with `seed`
        it fixes the random draw.
    prompt_token_ids / output_token_ids: history, for penalties.
    """

    params: SamplingParams
    seed: int
    output_index: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class Sampler:
    """Turns one row of logits per sequence into one token id (and optional logprobs).

    Stateless apart from the EOS ids: two instances give identical results.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        # masked (with params.stop_token_ids) until a sequence has min_tokens outputs
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos_token_ids)

    def sample(
        self, logits: torch.Tensor, seqs: list[SamplingSeq]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Samples one token per row.

        logits: [N, V], one row per entry of `seqs` (any float dtype, any device; not modified).
        Returns the N token ids and, per row, `TokenLogprobs` when `params.logprobs` is set
        (else None).
        """
        _check_inputs(logits, seqs)
        n = len(seqs)
        if n == 0:
            return [], []
        if all(self._is_plain_greedy(s) for s in seqs):
            # fast path: nothing modifies the logits, one batched argmax: the C kernel on
            # CPU float32 logits, else max(dim), which gives the same indices (first maximum
            # on ties, as documented) and is the faster torch op on CPU (docs/PERF_LOG.md,
            # "Second round" and "Eighth round")
            greedy = argmax_rows(logits)
            if greedy is None:
                greedy = logits.max(dim=-1).indices.tolist()
            return greedy, [None] * n

        device = logits.device
        x = logits.to(torch.float32, copy=True)  # [N, V], ours to modify in place

        penalty_rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if penalty_rows:
            _apply_penalties_(x, [seqs[i] for i in penalty_rows], penalty_rows)

        lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        logprobs_t: torch.Tensor | None = None
        if lp_rows:
            logprobs_t = torch.log_softmax(x[_index(lp_rows, device)], dim=-1)  # [L, V]

        _apply_min_tokens_(x, seqs, self.eos_token_ids)

        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            tokens = x.argmax(dim=-1)  # [N]
        else:
            if len(random_rows) == n:
                tokens = _draw(x, seqs)
            else:
                tokens = x.argmax(dim=-1)  # greedy rows keep these
                r = _index(random_rows, device)
                tokens[r] = _draw(x[r], [seqs[i] for i in random_rows])

        token_list: list[int] = tokens.tolist()
        out_logprobs: list[TokenLogprobs | None] = [None] * n
        if logprobs_t is not None:
            for row, lp in zip(
                lp_rows, _gather_logprobs(logprobs_t, tokens, lp_rows, seqs), strict=True
            ):
                out_logprobs[row] = lp
        return token_list, out_logprobs

    def _is_plain_greedy(self, s: SamplingSeq) -> bool:
        p = s.params
        min_tokens_active = s.output_index < p.min_tokens and bool(
            self.eos_token_ids or p.stop_token_ids
        )
        return p.greedy and not p.has_penalties and p.logprobs is None and not min_tokens_active


# ---------------------------------------------------------------------------------------
# Pieces, public so the tests (and anyone curious) can check each transformation exactly.


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> torch.Tensor:
    """Returns float32 logits [N, V] with each row's repetition/presence/frequency penalties.

    Repetition (HF): for every token in prompt or output, `l / r` if `l > 0` else `l * r`.
    Presence / frequency (OpenAI), over output tokens only:
    `l -= frequency_penalty * count + presence_penalty * (count > 0)`.
    """
    _check_inputs(logits, seqs)
    x = logits.to(torch.float32, copy=True)
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if rows:
        _apply_penalties_(x, [seqs[i] for i in rows], rows)
    return x


def apply_min_tokens(
    logits: torch.Tensor, seqs: Sequence[SamplingSeq], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Returns float32 logits [N, V] with EOS and stop ids at -inf in rows still short of
    min_tokens (output_index < min_tokens)."""
    _check_inputs(logits, seqs)
    x = logits.to(torch.float32, copy=True)
    _apply_min_tokens_(x, seqs, tuple(eos_token_ids))
    return x


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Returns float32 logits [N, V] divided by temperature, with tokens excluded by top-k,
    top-p and min-p (applied in that order) set to -inf.

    Rows with temperature 0 (greedy) are filtered but not scaled. Tie semantics, chosen so
    the result does not depend on sort stability: top-k keeps every token whose logit is
    >= the k-th largest; top-p keeps the smallest descending-probability prefix whose mass
    reaches p (the token that crosses p included), plus any token tied with its last member;
    min-p keeps tokens with probability >= min_p * (top probability).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits must be [N, V] with N == len(params)={len(params)}, "
            f"got shape {tuple(logits.shape)}"
        )
    if logits.shape[0] == 0:
        return logits.to(torch.float32, copy=True)
    return _filter(logits.to(torch.float32, copy=True), params)


# ---------------------------------------------------------------------------------------


def _check_inputs(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"logits must be [N, V] with N == len(seqs)={len(seqs)}, "
            f"got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating point tensor, got {logits.dtype}")
    for s in seqs:
        if s.output_index < 0:
            raise ValueError(f"SamplingSeq.output_index={s.output_index} must be >= 0")
        if not 0 <= s.seed < 2**64:
            raise ValueError(f"SamplingSeq.seed={s.seed} must be in [0, 2**64)")


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _flat_token_index(
    id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device, what: str
) -> torch.Tensor:
    """Indices into a flattened [len(id_lists), vocab] tensor: row * vocab + token id."""
    lengths = [len(ids) for ids in id_lists]
    for ids in id_lists:
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"{what} contain a token id outside [0, {vocab}): {list(ids)[:8]}...")
    ids_t = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    rows_t = torch.repeat_interleave(
        torch.arange(len(id_lists), dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    )
    return (rows_t * vocab + ids_t).to(device)  # [sum(lengths)]


def _apply_penalties_(x: torch.Tensor, seqs: Sequence[SamplingSeq], rows: Sequence[int]) -> None:
    """In place on rows `rows` of x [N, V]; seqs[j] belongs to x[rows[j]]."""
    m, vocab = len(rows), x.shape[1]
    device = x.device
    r = _index(rows, device)
    xr = x[r]  # [M, V] (a copy; written back below)

    # counts[j, t]: occurrences of token t in seq j's output (exact: sums of 1.0 < 2**24)
    out_idx = _flat_token_index(
        [s.output_token_ids for s in seqs], vocab, device, "output_token_ids"
    )
    counts = torch.zeros(m * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, out_idx, torch.ones_like(out_idx, dtype=torch.float32))
    counts = counts.view(m, vocab)  # [M, V]

    rep = [s.params.repetition_penalty for s in seqs]
    if any(p != 1.0 for p in rep):
        prompt_idx = _flat_token_index(
            [s.prompt_token_ids for s in seqs], vocab, device, "prompt_token_ids"
        )
        seen = torch.zeros(m * vocab, dtype=torch.bool, device=device)
        seen[prompt_idx] = True
        seen = seen.view(m, vocab) | (counts > 0)  # [M, V]
        rp = torch.tensor(rep, dtype=torch.float32, device=device).unsqueeze(1)  # [M, 1]
        xr = torch.where(seen, torch.where(xr > 0, xr / rp, xr * rp), xr)

    freq = [s.params.frequency_penalty for s in seqs]
    pres = [s.params.presence_penalty for s in seqs]
    if any(freq) or any(pres):
        f = torch.tensor(freq, dtype=torch.float32, device=device).unsqueeze(1)  # [M, 1]
        p = torch.tensor(pres, dtype=torch.float32, device=device).unsqueeze(1)  # [M, 1]
        xr = xr - f * counts - p * (counts > 0).to(torch.float32)
    x[r] = xr


def _apply_min_tokens_(
    x: torch.Tensor, seqs: Sequence[SamplingSeq], eos_token_ids: tuple[int, ...]
) -> None:
    """In place: -inf on EOS / stop ids of rows with output_index < min_tokens."""
    vocab = x.shape[1]
    banned: list[list[int]] = []
    for s in seqs:
        if s.output_index < s.params.min_tokens:
            # ids beyond the logits' vocab cannot be sampled anyway
            ids = {t for t in (*eos_token_ids, *s.params.stop_token_ids) if 0 <= t < vocab}
            banned.append(sorted(ids))
        else:
            banned.append([])
    if any(banned):
        flat = _flat_token_index(banned, vocab, x.device, "stop ids")
        x.view(-1).index_fill_(0, flat, float("-inf"))


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """x: float32 [N, V], ours. Temperature, top-k, top-p, min-p; returns the result."""
    vocab = x.shape[1]
    device = x.device
    neg_inf = float("-inf")

    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)

    sort_rows = [i for i, p in enumerate(params) if p.top_k != -1 or p.top_p < 1.0]
    if sort_rows:
        r = _index(sort_rows, device)
        xs = x[r]  # [M, V]
        ks = [min(params[i].top_k, vocab) if params[i].top_k != -1 else vocab for i in sort_rows]
        ps = [params[i].top_p for i in sort_rows]
        k_t = torch.tensor(ks, dtype=torch.long, device=device).unsqueeze(1)  # [M, 1]
        p_t = torch.tensor(ps, dtype=torch.float32, device=device).unsqueeze(1)  # [M, 1]
        # Only the largest values matter (ties need no order), and only a prefix of them:
        # up to the k-th for top-k, up to where the mass reaches p for top-p. A full sort
        # of the vocabulary is rarely needed: start from a window of the largest values
        # and widen it only for rows whose prefix does not end inside it.
        finite_k = [k for k in ks if k < vocab]
        if max(ks) < vocab:
            width = max(ks)  # every row has a top-k: its k largest values suffice
        else:
            width = max(_TOP_P_WINDOW, *finite_k) if finite_k else _TOP_P_WINDOW
        xs, sorted_vals = _top_k_mask(xs, k_t, min(width, vocab))
        if any(p < 1.0 for p in ps):
            # probabilities over the whole (top-k masked) row, whatever the window
            lse = torch.logsumexp(xs, dim=-1, keepdim=True)  # [M, 1]
            while True:
                probs = torch.exp(sorted_vals - lse)  # [M, W], descending
                cum = torch.cumsum(probs, dim=-1)  # prefix sums do not depend on W
                done = (cum[:, -1:] >= p_t) | (p_t >= 1.0)
                if sorted_vals.shape[1] >= vocab or bool(done.all()):
                    break
                width = min(vocab, 8 * sorted_vals.shape[1])
                xs, sorted_vals = _top_k_mask(xs, k_t, width)
            mass_before = cum - probs  # exclusive prefix sums
            n_keep = (mass_before < p_t).sum(dim=-1, keepdim=True).clamp_min(1)  # [M, 1]
            thresh = sorted_vals.gather(1, n_keep - 1)  # [M, 1], last kept logit
            # rows without top-p must not lose a float-rounding tail
            thresh = thresh.masked_fill(p_t >= 1.0, neg_inf)
            xs = xs.masked_fill(xs < thresh, neg_inf)
        x[r] = xs

    min_ps = [p.min_p for p in params]
    if any(min_ps):
        # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p): the ratio survives the
        # renormalisation after top-k/top-p; log(0) = -inf leaves rows without min-p alone
        log_min_p = torch.log(torch.tensor(min_ps, dtype=torch.float32, device=device))
        thresh = x.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)  # [N, 1]
        x = x.masked_fill(x < thresh, neg_inf)
    return x


# how many of the largest logits top-p looks at first (widened x8 while too few)
_TOP_P_WINDOW = 256


def _top_k_mask(
    xs: torch.Tensor, k_t: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k masking plus the `width` largest values of each row, descending.

    xs: [M, V]; k_t: [M, 1] (V = no top-k; every finite k <= width). Returns xs with the
    tokens below each row's k-th largest logit at -inf, and its top `width` values [M, W]
    (masked the same way).
    """
    vocab = xs.shape[1]
    if width < vocab:
        sorted_vals = xs.topk(width, dim=-1, sorted=True).values  # [M, W]
    else:
        sorted_vals = xs.sort(dim=-1, descending=True).values  # [M, V]
    # the k-th largest logit; rows without top-k keep everything
    kth = sorted_vals.gather(1, (k_t.clamp_max(width) - 1))  # [M, 1]
    kth = kth.masked_fill(k_t >= vocab, float("-inf"))
    return xs.masked_fill(xs < kth, float("-inf")), sorted_vals.masked_fill(
        sorted_vals < kth, float("-inf")
    )


def draw_seed(seed: int, output_index: int) -> int:
    """The generator seed for one draw: a stable hash of (seed, output_index)."""
    digest = hashlib.blake2b(
        seed.to_bytes(8, "little") + output_index.to_bytes(8, "little"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _draw(x: torch.Tensor, seqs: Sequence[SamplingSeq]) -> torch.Tensor:
    """x: float32 [M, V] penalized/masked logits of random rows. Returns [M] token ids."""
    x = _filter(x, [s.params for s in seqs])  # [M, V], excluded tokens at -inf
    noise = torch.empty_like(x)  # [M, V]
    for j, s in enumerate(seqs):
        gen = torch.Generator(device=x.device)
        gen.manual_seed(draw_seed(s.seed, s.output_index))
        noise[j].exponential_(generator=gen)
    # exponential race in log space: argmax p_i / q_i == argmax l_i - log q_i
    return (x - noise.clamp_min_(_MIN_NOISE).log_()).argmax(dim=-1)


def _gather_logprobs(
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    rows: Sequence[int],
    seqs: Sequence[SamplingSeq],
) -> list[TokenLogprobs]:
    """logprobs: [L, V] for `rows`; tokens: [N] sampled ids. One host transfer per tensor."""
    r = _index(rows, logprobs.device)
    sampled = logprobs.gather(1, tokens[r].unsqueeze(1)).squeeze(1).tolist()  # [L]
    ns = [seqs[i].params.logprobs or 0 for i in rows]
    max_n = max(ns)
    if max_n > 0:
        top_vals, top_ids = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)  # [L, n]
        vals, ids = top_vals.tolist(), top_ids.tolist()
    else:
        vals = ids = [[] for _ in rows]
    return [
        TokenLogprobs(logprob=lp, top_token_ids=i[:k], top_logprobs=v[:k])
        for lp, i, v, k in zip(sampled, ids, vals, ns, strict=True)
    ]
