"""What one iteration costs a model: matmul FLOPs and bytes moved (for rooflines, MFU, MBU)."""

from __future__ import annotations

from dataclasses import dataclass

from sarazmq.config import ModelConfig
from sarazmq.perf.architectures import Architecture, get_architecture
from sarazmq.scheduler import IterationShape


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of a Llama-family model on one tensor-parallel rank.

    linear_params: decoder-layer matmul weights, all layers (QKV, O, MLP).
    head_params: the LM head (the embedding when tied; still read every step).
    q_width / kv_width: num_heads * head_dim and num_kv_heads * head_dim (this rank's share).
    elem: bytes per element of weights and KV in the run dtype.
    """

    linear_params: int
    head_params: int
    num_layers: int
    q_width: int
    kv_width: int
    elem: int

    def __post_init__(self) -> None:
        if self.elem < 1:
            raise ValueError(f"elem={self.elem} must be >= 1 (bytes per element)")

    @classmethod
    def from_architecture(cls, arch: Architecture | str, elem: int, tp: int = 1) -> ModelCost:
        """The costs of one of `tp` tensor-parallel ranks (weights and heads split evenly)."""
        if isinstance(arch, str):
            arch = get_architecture(arch)
        if tp < 1:
            raise ValueError(f"tp={tp} must be >= 1")
        h, d = arch.hidden_size, arch.head_dim
        q, kv = arch.num_heads * d, arch.num_kv_heads * d
        mlp = (3 if arch.gated_mlp else 2) * h * arch.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + mlp
        return cls(
            linear_params=arch.num_layers * per_layer // tp,
            head_params=arch.vocab_size * h // tp,
            num_layers=arch.num_layers,
            q_width=q // tp,
            kv_width=max(kv // tp, d),  # KV heads are replicated when tp > num_kv_heads
            elem=elem,
        )

    @classmethod
    def from_model_config(cls, config: ModelConfig, elem: int, tp: int = 1) -> ModelCost:
        return cls.from_architecture(Architecture.from_model_config(config), elem, tp)

    # --- the pieces

    @property
    def weight_bytes(self) -> float:
        """Every matmul weight read once (decoder layers and LM head)."""
        return float((self.linear_params + self.head_params) * self.elem)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one position, all layers."""
        return float(2 * self.kv_width * self.num_layers * self.elem)

    def linear_flops(self, num_tokens: int) -> float:
        return 2.0 * self.linear_params * num_tokens

    def attention_flops(self, pairs: int) -> float:
        """QK^T and PV over `pairs` (query, key) pairs, all layers."""
        return 4.0 * self.q_width * self.num_layers * pairs

    def head_flops(self, rows: int) -> float:
        return 2.0 * self.head_params * rows

    # --- one iteration

    def flops(self, shape: IterationShape) -> float:
        """Matmul FLOPs: linear layers, causal attention (prefill pairs and one pair per
        key a decode reads), LM head rows."""
        return (
            self.linear_flops(shape.num_tokens)
            + self.attention_flops(shape.prefill_attention_pairs + shape.decode_context_tokens)
            + self.head_flops(shape.num_sampled)
        )

    def bytes(self, shape: IterationShape) -> float:
        """Bytes moved: every weight once, the KV every chunk and decode reads, the KV of
        every new token written."""
        kv_tokens = kv_read_tokens(shape) + shape.num_tokens
        return self.weight_bytes + self.kv_bytes_per_token * kv_tokens


def prefill_context_tokens(shape: IterationShape) -> float:
    """Positions computed before this iteration's prefill chunks, summed over the chunks.

    Exact for one chunk (or chunks of one size); with chunks of different sizes the shape
    no longer holds each start, and this assumes equal chunks."""
    n, q = shape.num_prefill_seqs, shape.num_prefill_tokens
    if n == 0 or q == 0:
        return 0.0
    size = q / n
    inside = n * size * (size + 1) / 2  # pairs within the chunks themselves
    return max(0.0, (shape.prefill_attention_pairs - inside) / size)


def kv_read_tokens(shape: IterationShape) -> float:
    """KV positions attention reads: each chunk its context and itself, each decode p + 1."""
    return prefill_context_tokens(shape) + shape.num_prefill_tokens + shape.decode_context_tokens
