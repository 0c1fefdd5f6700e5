"""Sampler: greedy, seeded reproducibility, distribution, filters, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from sarazmq.kernels.argmax import argmax_rows
from sarazmq.kernels.native import load_library
from sarazmq.sampling_params import SamplingParams
from sarazmq.worker.sampler import (
    Sampler,
    SamplingSeq,
    apply_filters,
    apply_min_tokens,
    apply_penalties,
    draw_seed,
)

pytestmark = pytest.mark.one_torch_thread

NEG_INF = float("-inf")


def seq(
    params: SamplingParams | None = None,
    seed: int = 0,
    output_index: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> SamplingSeq:
    return SamplingSeq(
        params=params or SamplingParams(),
        seed=seed,
        output_index=output_index,
        prompt_token_ids=prompt or [0],
        output_token_ids=output or [],
    )


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# ---- greedy --------------------------------------------------------------------------


def test_greedy_argmax_and_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 1.0, 3.0, 3.0], [-5.0, -4.0, -4.5, -9.0]])
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(3)]
    tokens, lps = Sampler().sample(logits, seqs)
    assert tokens == [1, 0, 1]
    assert lps == [None, None, None]
    # the general path (logprobs requested) agrees with the fast path
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(3)]
    tokens2, lps2 = Sampler().sample(logits, seqs)
    assert tokens2 == tokens
    assert all(lp is not None for lp in lps2)


@pytest.mark.skipif(load_library() is None, reason="native kernels not built")
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 100, 49152])
def test_native_argmax_matches_torch_max(cols: int) -> None:
    # the greedy fast path's C argmax against torch.max(dim).indices: random rows, ties
    # (the first maximum), NaNs (the first NaN), a row of -inf, rows past a vector's end
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols + 3, generator=g)[:, 3:]  # a row stride that is not cols
    x[1, cols // 2 :] = 50.0  # tie: the first of them
    x[2, -1] = 99.0  # the maximum in the last (scalar tail) element
    x[3, cols // 3] = float("nan")
    x[3, -1] = float("nan")
    x[4] = NEG_INF
    x[5, 0] = float("inf")
    x[6] = torch.round(x[6])  # many ties
    assert argmax_rows(x) == x.max(dim=-1).indices.tolist()
    assert argmax_rows(torch.zeros(0, cols)) == []
    # what it does not take: other dtypes, a strided row, no columns
    assert argmax_rows(x.to(torch.bfloat16)) is None
    assert argmax_rows(torch.zeros(4, 2 * cols + 2)[:, ::2]) is None
    assert argmax_rows(torch.zeros(4, 0)) is None


def test_input_logits_not_modified_and_bad_shape_rejected() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    before = logits.clone()
    p = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, min_p=0.1)
    Sampler([2]).sample(logits, [seq(p, output=[2])])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="len\\(seqs\\)"):
        Sampler().sample(torch.zeros(2, 3), [seq()])
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler().sample(torch.zeros(1, 3), [seq(SamplingParams(presence_penalty=1.0), output=[7])])


# ---- reproducibility -----------------------------------------------------------------


def uniform(n: int, vocab: int = 1000) -> torch.Tensor:
    return torch.zeros(n, vocab)


def test_seeded_sample_independent_of_batch_and_instance() -> None:
    target = seq(SamplingParams(temperature=1.0), seed=1234, output_index=7)
    logits_row = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    alone, _ = Sampler().sample(logits_row, [target])

    others = [
        seq(SamplingParams(temperature=0.0)),
        seq(SamplingParams(temperature=0.7, top_k=5), seed=99),
        seq(SamplingParams(temperature=1.3, logprobs=2, presence_penalty=0.5), seed=5, output=[3]),
    ]
    other_logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    for pos in range(4):
        batch = others[:pos] + [target] + others[pos:]
        logits = torch.cat([other_logits[:pos], logits_row, other_logits[pos:]])
        tokens, _ = Sampler(eos_token_ids=[2]).sample(logits, batch)
        assert tokens[pos] == alone[0], f"row position {pos}"

    # after a recompute preemption the history is rebuilt, but (seed, output_index) and the
    # logits are what count
    rebuilt = seq(SamplingParams(temperature=1.0), seed=1234, output_index=7, output=[5] * 7)
    assert Sampler().sample(logits_row, [rebuilt])[0] == alone


def test_different_seeds_and_output_indices_differ() -> None:
    n = 40
    by_seed, _ = Sampler().sample(uniform(n), [seq(seed=s) for s in range(n)])
    by_index, _ = Sampler().sample(uniform(n), [seq(seed=7, output_index=i) for i in range(n)])
    # 40 uniform draws over 1000 tokens: a few collisions at most
    assert len(set(by_seed)) >= n - 4
    assert len(set(by_index)) >= n - 4
    assert draw_seed(1, 2) != draw_seed(2, 1)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def draw_counts(logits_row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    logits = logits_row.expand(n, -1).contiguous()
    tokens, _ = Sampler().sample(logits, [seq(params, seed=s) for s in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).tolist()


def test_empirical_distribution_matches_softmax_with_temperature() -> None:
    row = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0]])
    t = 0.7
    counts = draw_counts(row, SamplingParams(temperature=t), 4000)
    expected = torch.softmax(row[0] / t, dim=-1).tolist()
    # df = 4: P(chi2 > 18.5) = 0.001; the draws are seeded, so this is deterministic
    assert chi_square(counts, expected) < 18.5
    # the test can tell the temperature apart: the T=1 distribution is far off
    assert chi_square(counts, torch.softmax(row[0], dim=-1).tolist()) > 100


def test_empirical_distribution_with_top_k_renormalises() -> None:
    row = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0]])
    counts = draw_counts(row, SamplingParams(temperature=1.0, top_k=3), 3000)
    assert counts[2] == 0 and counts[4] == 0
    sub = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), dim=-1).tolist()
    assert chi_square([counts[0], counts[1], counts[3]], sub) < 13.8  # df=2, p=0.001


# ---- filters -------------------------------------------------------------------------

# probabilities 0.5, 0.3, 0.15, 0.05 at shuffled positions, so nothing depends on index order
PROBS = {3: 0.5, 0: 0.3, 4: 0.15, 1: 0.05}
FILTER_ROW = torch.tensor([[math.log(PROBS[i]) if i in PROBS else NEG_INF for i in range(5)]])
FILTER_ROW[0, 2] = math.log(1e-9)  # a fifth, negligible token


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), {0, 1, 2, 3, 4}),
        (SamplingParams(top_k=1), {3}),
        (SamplingParams(top_k=2), {3, 0}),
        (SamplingParams(top_k=100), {0, 1, 2, 3, 4}),
        (SamplingParams(top_p=0.45), {3}),
        (SamplingParams(top_p=0.55), {3, 0}),
        (SamplingParams(top_p=0.85), {3, 0, 4}),
        (SamplingParams(top_p=0.97), {3, 0, 4, 1}),
        (SamplingParams(min_p=0.5), {3, 0}),
        (SamplingParams(min_p=0.25), {3, 0, 4}),
        (SamplingParams(min_p=0.05), {3, 0, 4, 1}),
        # top-p after top-k sees renormalised probabilities: {0.625, 0.375} -> only 3
        (SamplingParams(top_k=2, top_p=0.6), {3}),
        (SamplingParams(top_p=0.6), {3, 0}),
        # temperature first: T=2 flattens to ~(0.38, 0.29, 0.21, 0.12): mass before the
        # third token is 0.67 < 0.7, whereas at T=1 it is 0.8
        (SamplingParams(top_p=0.7), {3, 0}),
        (SamplingParams(temperature=2.0, top_p=0.7), {3, 0, 4}),
        (SamplingParams(temperature=2.0, min_p=0.5), {3, 0, 4}),
    ],
)
def test_filters_exclude_exactly(params: SamplingParams, expected: set[int]) -> None:
    out = apply_filters(FILTER_ROW, [params])
    assert kept(out[0]) == expected


def test_filters_vectorised_rows_match_single_rows() -> None:
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.55, temperature=0.5),
        SamplingParams(min_p=0.25),
        SamplingParams(),
        SamplingParams(top_k=3, top_p=0.9, min_p=0.1, temperature=1.5),
    ]
    logits = torch.randn(len(params), 50, generator=torch.Generator().manual_seed(3))
    batched = apply_filters(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(batched[i], apply_filters(logits[i : i + 1], [p])[0])
    # a row without filters is untouched (no float-rounding tail lost)
    assert torch.equal(batched[3], logits[3])


def test_top_k_keeps_ties() -> None:
    row = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert kept(apply_filters(row, [SamplingParams(top_k=2)])[0]) == {1, 2, 3}


def test_sampled_tokens_stay_inside_the_filtered_set() -> None:
    row = FILTER_ROW
    for params, allowed in [
        (SamplingParams(top_k=2), {3, 0}),
        (SamplingParams(top_p=0.55), {3, 0}),
        (SamplingParams(min_p=0.25), {3, 0, 4}),
    ]:
        counts = draw_counts(row, params, 600)
        assert {i for i, c in enumerate(counts) if c} == allowed


# ---- penalties -----------------------------------------------------------------------


def reference_penalties(logits: list[float], s: SamplingSeq) -> list[float]:
    p = s.params
    out = list(logits)
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        c = list(s.output_token_ids).count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_change_logits_exactly_as_defined() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    seqs = [
        # repetition only: prompt tokens 0 (positive) and 1 (negative), output token 3
        seq(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 1], output=[3]),
        # presence/frequency count output tokens only; prompt token 5 untouched
        seq(
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[5],
            output=[2, 2, 2, 4],
        ),
        seq(
            SamplingParams(repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=1.0),
            prompt=[4, 0],
            output=[1, 1, 0],
        ),
        seq(SamplingParams(), prompt=[0, 1, 2], output=[3]),  # no penalties: unchanged
    ]
    out = apply_penalties(logits, seqs)
    for i, s in enumerate(seqs):
        expected = reference_penalties(logits[i].tolist(), s)
        assert out[i].tolist() == pytest.approx(expected, abs=1e-6), i
    # spot checks of the definitions themselves
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == -2.0 and out[0, 3].item() == 1.5
    assert out[1, 2].item() == pytest.approx(0.5 - 0.75 - 0.5)
    assert out[1, 5].item() == 1.0
    assert torch.equal(out[3], logits[3])


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler().sample(logits, [seq(p, output=[1])])[0] == [2]
    assert Sampler().sample(logits, [seq(SamplingParams(temperature=0.0), output=[1])])[0] == [1]


# ---- min_tokens ----------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5, 4.0]])
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    sampler = Sampler(eos_token_ids=[2])
    assert sampler.sample(logits, [seq(p, output_index=2)])[0] == [1]
    assert sampler.sample(logits, [seq(p, output_index=3)])[0] == [2]
    masked = apply_min_tokens(
        logits.expand(2, -1), [seq(p, output_index=0), seq(p, output_index=3)], [2]
    )
    assert kept(masked[0]) == {0, 1, 3}
    assert torch.equal(masked[1], logits[0])
    # random sampling never draws a masked id either
    pr = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[4])
    tokens, _ = sampler.sample(
        logits.expand(200, -1), [seq(pr, seed=s, output_index=1) for s in range(200)]
    )
    assert 2 not in tokens and 4 not in tokens


# ---- logprobs ------------------------------------------------------------------------


def test_logprobs_match_log_softmax_of_penalised_logits() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(11))
    seqs = [
        seq(SamplingParams(temperature=0.0, logprobs=3)),
        seq(SamplingParams(temperature=0.5, logprobs=5, presence_penalty=1.0), seed=4, output=[7]),
        seq(SamplingParams(temperature=1.0)),
    ]
    tokens, lps = Sampler().sample(logits, seqs)
    ref = torch.log_softmax(apply_penalties(logits, seqs), dim=-1)  # before temperature
    for i in (0, 1):
        lp = lps[i]
        assert lp is not None
        n = seqs[i].params.logprobs
        assert lp.logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        top = torch.topk(ref[i], n)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert lps[2] is None
    # greedy: the sampled token is the top-1
    assert lps[0].top_token_ids[0] == tokens[0]


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    _, lps = Sampler().sample(logits, [seq(SamplingParams(temperature=0.0, logprobs=0))])
    lp = lps[0]
    assert lp is not None and lp.top_token_ids == [] and lp.top_logprobs == []
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def _top_p_by_full_sort(row: torch.Tensor, p: float) -> set[int]:
    """The definition, directly: smallest descending prefix whose mass reaches p, + ties."""
    probs = torch.softmax(row.double(), dim=-1)
    order = torch.argsort(probs, descending=True)
    total, kept_ids = 0.0, []
    for i in order.tolist():
        if total >= p:
            break
        kept_ids.append(i)
        total += float(probs[i])
    last = probs[kept_ids[-1]]
    return {i for i in range(row.numel()) if probs[i] >= last}


@pytest.mark.parametrize("spread", [1.0, 4.0, 0.05])
def test_top_p_window_matches_full_sort(monkeypatch: pytest.MonkeyPatch, spread: float) -> None:
    # peaked rows end inside the first window of largest logits; nearly flat rows
    # (spread 0.05) need it widened, up to the whole vocabulary
    import sarazmq.worker.sampler as sampler_mod

    vocab = 5000
    g = torch.Generator().manual_seed(int(spread * 100))
    logits = torch.randn(4, vocab, generator=g) * spread
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, temperature=0.7),
        SamplingParams(top_k=50, top_p=0.8),
        SamplingParams(top_k=300),
    ]
    windowed = apply_filters(logits, params)
    monkeypatch.setattr(sampler_mod, "_TOP_P_WINDOW", vocab)  # always a full sort
    full = apply_filters(logits, params)
    assert torch.equal(windowed, full)
    assert kept(windowed[0]) == _top_p_by_full_sort(logits[0], 0.9)
    assert kept(windowed[1]) == _top_p_by_full_sort(logits[1] / 0.7, 0.5)
    assert len(kept(windowed[3])) == 300
    assert kept(windowed[2]) <= set(torch.topk(logits[2], 50).indices.tolist())
