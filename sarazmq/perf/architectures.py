"""Named model architectures and GPUs, for latency models of hardware we do not have.

The architecture numbers are the models' published Hugging Face configs; the GPU numbers are
the vendors' dense (no sparsity) BF16 tensor-core peaks and HBM bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarazmq.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """The shapes of a Llama-family decoder (what its cost depends on).

    gated_mlp: a SwiGLU MLP (gate, up and down matrices); False: up and down only (GELU).
    tied_embeddings: the LM head is the embedding (the head's weights are still read).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = True
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"architecture {self.name!r}: {field} must be >= 1")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"architecture {self.name!r}: num_heads={self.num_heads} is not a multiple "
                f"of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_model_config(cls, config: ModelConfig, name: str = "") -> Architecture:
        """The architecture of a loaded model's config (our models are all gated)."""
        return cls(
            name=name or config.architecture,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            gated_mlp=True,
            tied_embeddings=config.tie_word_embeddings,
        )


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        Architecture("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
        # Mistral-7B v0.1/v0.2 (v0.3 grew the vocabulary to 32768)
        Architecture("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000),
        Architecture("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        Architecture("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000),
        Architecture("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        Architecture("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        # Falcon-180B: multi-query groups of 8 KV heads, a plain 4x GELU MLP
        Architecture("falcon-180b", 80, 14848, 232, 8, 64, 59392, 65024, gated_mlp=False),
        # the default model here (SmolLM2-135M-Instruct)
        Architecture("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
    )
}


@dataclass(frozen=True)
class Gpu:
    """A GPU's limits: dense BF16 tensor-core FLOP/s, HBM bytes/s, and the link that
    tensor-parallel all-reduces cross (NVLink bytes/s per direction)."""

    name: str
    peak_flops: float
    bandwidth: float
    memory_bytes: float
    link_bandwidth: float


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("a100-80gb", 312e12, 2.039e12, 80e9, 300e9),
        Gpu("h100-sxm", 989e12, 3.35e12, 80e9, 450e9),
        Gpu("h200", 989e12, 4.8e12, 141e9, 450e9),
    )
}

#: other spellings accepted for the GPUs
GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}


def get_architecture(name: str) -> Architecture:
    """The named architecture, or a ValueError listing the known ones."""
    key = name.strip().lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[key]


def get_gpu(name: str) -> Gpu:
    """The named GPU (aliases: a100, h100), or a ValueError listing the known ones."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join([*GPUS, *GPU_ALIASES])
        raise ValueError(f"unknown GPU {name!r}; known: {known}")
    return GPUS[key]
