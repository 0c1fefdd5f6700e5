"""Frozen configuration, resolved once before any process starts.

Every config here is a frozen dataclass; msgspec encodes/decodes dataclasses, so
children receive their config as msgpack bytes (never pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("sarathi", "vllm", "orca", "fastertransformer", "simple_chunking")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash_attn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "linear" | "llama3" | "dynamic" (dynamic treated as none)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model (Llama 2/3, Mistral, SmolLM, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` tokens (0 = size from memory)."""

    block_size: int = 16
    num_blocks: int = 0
    # fraction of available memory used for the KV pool when num_blocks == 0
    memory_fraction: float = 0.25


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy and its limits.

    chunk_size: the per-iteration token budget (Sarathi's chunk size).
    max_num_seqs: most requests running at once.
    watermark: fraction of KV blocks kept free at admission, so running decodes do not
        immediately preempt newly admitted requests.
    max_model_len: longest prompt + output a request may reach (<= model context).
    """

    policy: str = "sarathi"
    chunk_size: int = 256
    max_num_seqs: int = 64
    watermark: float = 0.01
    max_model_len: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {self.policy!r}; choose one of {POLICIES}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; resolved (paths, sizes) before start."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    attention_backend: str = "auto"
    # True: always run the model op by op; False: decode steps of a few sequences may run
    # as one native call where the backend has one (the CPU's fused decode step, see
    # sarazmq.kernels.decode_step), as vLLM's enforce_eager turns off captured graphs
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    num_threads: int = 0
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose one of {ATTENTION_BACKENDS}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
