"""Named Llama-family architectures: the shapes of published models, without weights.

Used by the latency models (`sarazmq.perf`: what an iteration costs on a GPU we do not
have) and by `--load-format dummy` (a model of these shapes with random weights, to
measure speed at real sizes where no checkpoint can be downloaded). The numbers are the
models' published Hugging Face configs.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarazmq.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    """The shapes of a Llama-family decoder (what its cost depends on).

    gated_mlp: a SwiGLU MLP (gate, up and down matrices); False: up and down only (GELU).
    tied_embeddings: the LM head is the embedding (the head's weights are still read).
    max_position, rope_theta, rms_norm_eps: the rest of the config a model of these shapes
    needs (`to_model_config`); they do not change an iteration's cost.
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
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

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

    def to_model_config(self) -> ModelConfig:
        """The config of a model of these shapes (no special tokens: a model with random
        weights has none; ValueError for shapes our Llama model cannot build)."""
        if not self.gated_mlp:
            raise ValueError(
                f"architecture {self.name!r} has a plain (GELU) MLP; the engine's model is "
                "a gated (SwiGLU) Llama-family decoder"
            )
        return ModelConfig(
            architecture=self.name,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position=self.max_position,
            tie_word_embeddings=self.tied_embeddings,
        )


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        Architecture("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
        # Mistral-7B v0.1/v0.2 (v0.3 grew the vocabulary to 32768)
        Architecture("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, max_position=32768),
        Architecture(
            "llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_position=8192, rope_theta=5e5
        ),
        Architecture("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000, rope_theta=5e6),
        Architecture("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        Architecture(
            "llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, max_position=8192, rope_theta=5e5
        ),
        # Falcon-180B: multi-query groups of 8 KV heads, a plain 4x GELU MLP
        Architecture("falcon-180b", 80, 14848, 232, 8, 64, 59392, 65024, gated_mlp=False),
        # Llama-3.2-1B (its 128k context needs llama3 rope scaling, which these shapes
        # leave out: the random-weight model keeps to 8k)
        Architecture(
            "llama-3.2-1b",
            16,
            2048,
            32,
            8,
            64,
            8192,
            128256,
            tied_embeddings=True,
            max_position=8192,
            rope_theta=5e5,
        ),
        # the default model here (SmolLM2-135M-Instruct)
        Architecture(
            "smollm2-135m",
            30,
            576,
            9,
            3,
            64,
            1536,
            49152,
            tied_embeddings=True,
            max_position=8192,
            rope_theta=1e5,
        ),
    )
}


def get_architecture(name: str) -> Architecture:
    """The named architecture, or a ValueError listing the known ones."""
    key = name.strip().lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[key]
