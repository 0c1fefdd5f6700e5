"""How close two ways of computing a model are, token by token: teacher-forced next-token
distributions over a fixed text, compared by top-1 agreement and KL divergence (the
measures llama.cpp's `perplexity --kl-divergence` reports for its quantizations).

Used by scripts/accuracy_gguf.py (float32 against `gguf_matmul="int8"` and llama.cpp on
the same GGUF file) and tests/test_token_agreement.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM

_BLOCK = 16


@dataclass(frozen=True)
class Agreement:
    """One path's next-token distributions against a reference's, over `positions` tokens.

    top1_agreement: the fraction of positions where both put the same token first;
    mean_kl / p99_kl / max_kl: KL(reference || path) in nats per position;
    perplexity: of the text itself under the path (exp of the mean negative log-likelihood
    of each actual next token), beside the reference's own."""

    positions: int
    top1_agreement: float
    mean_kl: float
    p99_kl: float
    max_kl: float
    perplexity: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def teacher_forced_logits(
    model: LlamaForCausalLM, ids: list[int], chunk: int, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """float32 logits [len(ids), vocab]: position i is the model's distribution of token
    i + 1 given ids[: i + 1], computed as the engine serves a prompt (prefill chunks of
    `chunk` tokens through a paged KV cache of `kv_cache_dtype`)."""
    if not ids or chunk < 1:
        raise ValueError(f"need a non-empty text and chunk >= 1 (got {len(ids)} ids, {chunk})")
    n_blocks = (len(ids) + _BLOCK - 1) // _BLOCK
    dtype = model.embed_tokens.dtype
    device = model.embed_tokens.device
    caches = allocate_kv_cache(
        model.config, n_blocks + 1, _BLOCK, dtype, device, kv_cache_dtype=kv_cache_dtype
    )
    table = list(range(1, n_blocks + 1))
    rows = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            meta = AttentionMetadata.build(
                [len(part)], [start + len(part)], [table], _BLOCK, device
            )
            positions = torch.arange(start, start + len(part), device=device)
            hidden = model(torch.tensor(part, device=device), positions, caches, meta)
            rows.append(model.compute_logits(hidden).float())  # [len(part), vocab]
    return torch.cat(rows)


def _per_position(
    reference: torch.Tensor, logits: torch.Tensor, ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL(reference || logits) [T], top-1 equal [T] (0/1) and the path's negative
    log-likelihood of each next token [T - 1], in float64."""
    if reference.shape != logits.shape or reference.dim() != 2:
        raise ValueError(f"shapes differ: {tuple(reference.shape)} vs {tuple(logits.shape)}")
    if reference.shape[0] != len(ids) or len(ids) < 2:
        raise ValueError(f"need >= 2 ids and one row per id (got {len(ids)} ids)")
    ref_logp = torch.log_softmax(reference.double(), dim=-1)  # [T, V]
    logp = torch.log_softmax(logits.double(), dim=-1)  # [T, V]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # [T]
    top1 = (reference.argmax(-1) == logits.argmax(-1)).double()  # [T]
    targets = torch.tensor(ids[1:], device=logp.device)
    nll = -logp[:-1].gather(1, targets[:, None])[:, 0]  # [T - 1]
    return kl, top1, nll


def compare(reference: torch.Tensor, logits: torch.Tensor, ids: list[int]) -> Agreement:
    """`logits` against `reference` (both [len(ids), vocab], position i predicting token
    i + 1 of `ids`); the perplexity is over the len(ids) - 1 positions that have a next
    token. ValueError on shapes that do not match."""
    return pooled([(reference, logits, ids)])


def pooled(texts: list[tuple[torch.Tensor, torch.Tensor, list[int]]]) -> Agreement:
    """compare() over several texts (reference, logits, ids) at once: every position of
    every text weighs the same."""
    if not texts:
        raise ValueError("no texts to compare")
    kl, top1, nll = (torch.cat(parts) for parts in zip(*(_per_position(*t) for t in texts)))
    return Agreement(
        positions=int(kl.numel()),
        top1_agreement=float(top1.mean()),
        mean_kl=float(kl.mean()),
        p99_kl=float(torch.quantile(kl, 0.99)),
        max_kl=float(kl.max()),
        perplexity=float(nll.mean().exp()),
    )
