"""Frozen configuration, resolved once before any process starts.

Every config here is a frozen dataclass; msgspec encodes/decodes dataclasses, so
children receive their config as msgpack bytes (never pickle).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("sarathi", "vllm", "orca", "fastertransformer", "simple_chunking")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
# "auto": the model's dtype; "int8": rows of int8 values and a scale (sarazmq.kernels.kv_int8)
KV_CACHE_DTYPES = ("auto", "int8")
#: "auto": the model's weights; "dummy": random weights of its shapes (`--load-format`)
LOAD_FORMATS = ("auto", "dummy")
# how matmuls on a GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 blocks compute (EngineConfig.gguf_matmul;
# "auto" is resolved to one of the others before processes start, sarazmq.resolve)
GGUF_MATMULS = ("auto", "float", "int8")
RESTART_POLICIES = ("no", "on-failure")
#: how a request is routed to one of several engine instances (`sarazmq.router`)
ROUTER_POLICIES = ("round-robin", "least-load", "cache-aware")
DEFAULT_MODEL = "smollm2-135m-instruct"
#: Seconds a client with requests in flight may leave heartbeats unanswered before the
#: frontend treats it as gone and aborts its requests.
DEFAULT_CLIENT_TIMEOUT_S = 15.0
#: The per-iteration token budget and running-request cap an engine gets by default: the
#: Sarathi-Serve paper's budget (512), and vLLM's CPU server's cap (128). At saturation on
#: a 2-core CPU the pair gives ~1.1x the throughput of 256 / 64 at ~1.5x its P99
#: inter-token latency, still about half of vLLM's own default (docs/PERF_LOG.md,
#: "Tenth round").
DEFAULT_CHUNK_SIZE = 512
DEFAULT_MAX_NUM_SEQS = 128


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
    """Paged KV cache: `num_blocks` blocks of `block_size` tokens (0 = size from memory).

    enable_prefix_caching: reuse the KV of shared prompt prefixes, whole blocks at a time
    (docs/PREFIX_CACHING.md); greedy outputs are the same either way.
    kv_cache_dtype: "auto" (the model's dtype) or "int8" (0.53x the bytes of bf16, 0.27x
    those of float32 per token at head size 64, ~7 bits of precision per row;
    `sarazmq.kernels.kv_int8`).
    """

    block_size: int = 16
    num_blocks: int = 0
    # fraction of available memory used for the KV pool when num_blocks == 0
    memory_fraction: float = 0.25
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy and its limits.

    chunk_size: the per-iteration token budget (Sarathi's chunk size).
    max_num_seqs: most requests running at once.
    watermark: fraction of KV blocks kept free at admission, so running decodes do not
        immediately preempt newly admitted requests.
    max_model_len: longest prompt + output a request may reach (<= model context).
    max_waiting: most requests waiting for admission; a new request beyond it is refused
        as overloaded (HTTP 503), so a flood cannot queue without bound (0 = unbounded).
    tbt_slo: time-between-tokens target in seconds (sarathi policy only; 0 = off). With
        it each iteration's budget is the largest chunk whose predicted time fits the
        running decodes' slack, and chunk_size is its upper bound (see
        `sarazmq.scheduler.adaptive`).
    latency_profile: a `sarazmq profile` JSON whose model seeds the budget's latency
        model ("" = calibrate at startup with a few short internal requests).
    """

    policy: str = "sarathi"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    watermark: float = 0.01
    max_model_len: int = 0
    max_waiting: int = 0
    tbt_slo: float = 0.0
    latency_profile: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {self.policy!r}; choose one of {POLICIES}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting} must be >= 0 (0 = unbounded)")
        if not (self.tbt_slo >= 0 and math.isfinite(self.tbt_slo)):
            raise ValueError(f"tbt_slo={self.tbt_slo} must be a finite number of seconds >= 0")
        if self.tbt_slo and self.policy != "sarathi":
            raise ValueError(
                f"tbt_slo needs the sarathi policy (policy={self.policy!r} has no token budget "
                "to adapt)"
            )
        if self.latency_profile and not self.tbt_slo:
            raise ValueError("latency_profile is only used with tbt_slo > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; resolved (paths, sizes) before start.

    Built from flat options by `sarazmq.options.EngineOptions.to_config()` (`LLM(...)`,
    every command, the simulator); `sarazmq.resolve` fills in what "auto"/0 leave open."""

    model: str = DEFAULT_MODEL
    # "dummy": random weights of the model's shapes; `model` may then name an architecture
    # (sarazmq.model.architectures), the tokenizer being the default model's
    load_format: str = "auto"
    # "auto": bfloat16 where the hardware computes it natively, else float32 (resolve_dtype)
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    attention_backend: str = "auto"
    # True: always run the model op by op; False: decode steps of a few sequences may run
    # as one native call where the backend has one (the CPU's fused decode step, see
    # sarazmq.kernels.decode_step), as vLLM's enforce_eager turns off captured graphs
    enforce_eager: bool = False
    # decode-only batches of up to this many sequences replay a captured CUDA graph (CUDA,
    # with a backend whose decodes can be captured: triton; one worker per model); 0: never
    # (sarazmq.worker.cuda_graphs). enforce_eager turns graphs off too, as in vLLM.
    cuda_graph_max_batch: int = 128
    # the scheduler builds plan N+1 while the worker runs plan N (vLLM V1's asynchronous
    # scheduling): two plans in flight, the worker feeding a decode the token it sampled
    # (sarazmq.scheduler.inflight); one worker (tp = pp = 1), co-located instances
    async_scheduling: bool = False
    tensor_parallel_size: int = 1
    # pipeline stages: the layers split into this many contiguous groups, one worker group
    # (of tensor_parallel_size ranks) each; the scheduler keeps this many plans in flight
    pipeline_parallel_size: int = 1
    num_threads: int = 0
    seed: int = 0
    # data-parallel replicas: this many independent instances (scheduler, workers, KV
    # pool; tp x pp workers each) behind one frontend, which routes each request by
    # `router` (`sarazmq.router`)
    data_parallel_size: int = 1
    router: str = "cache-aware"
    # a disaggregated deployment: prefill_instances that compute prompts and their first
    # token, decode_instances that pull the prompt's KV and make the rest (0 and 0:
    # co-located, every instance does both)
    prefill_instances: int = 0
    decode_instances: int = 0
    # matmuls on a GGUF checkpoint's quantized blocks (CPU, float32): "float" rebuilds the
    # float32 weights (bitwise the dequantized model); "int8" quantizes the activations per
    # 32-block and takes integer dot products, llama.cpp's way and precision
    # (sarazmq.kernels.int8_dot); "auto" is int8 where that was measured faster (a GGUF
    # model in float32 on an AVX2 CPU without AVX-512 or a VNNI one), else float
    # (`resolve_gguf_matmul`)
    gguf_matmul: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"cuda_graph_max_batch={self.cuda_graph_max_batch} must be >= 0 (0 = no graphs)"
            )
        if self.gguf_matmul not in GGUF_MATMULS:
            raise ValueError(
                f"unknown gguf_matmul {self.gguf_matmul!r}; choose one of {GGUF_MATMULS}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"unknown load format {self.load_format!r}; choose one of {LOAD_FORMATS}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose one of {ATTENTION_BACKENDS}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        if self.router not in ROUTER_POLICIES:
            raise ValueError(f"unknown router {self.router!r}; choose one of {ROUTER_POLICIES}")
        p, d = self.prefill_instances, self.decode_instances
        if (p > 0) != (d > 0) or p < 0 or d < 0:
            raise ValueError(
                f"prefill_instances={p} and decode_instances={d}: a disaggregated deployment "
                "needs >= 1 of each (0 and 0: co-located)"
            )
        if p and self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} with a disaggregated deployment: "
                "its instances are --prefill-instances and --decode-instances"
            )
        if self.cache.kv_cache_dtype == "int8" and self.attention_backend in (
            "flash_attn",
            "triton",
        ):
            raise ValueError(
                f"kv_cache_dtype='int8' is not supported by the {self.attention_backend} "
                "attention backend (its kernels read fp32/fp16/bf16 caches); use "
                "--attention-backend torch or cpu"
            )
        if self.async_scheduling and (
            self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or p
        ):
            # the worker that samples feeds the next plan its token; other ranks and stages
            # learn tokens from the plans, and a prefill instance parks a request after its
            # first token, which a plan built ahead would already decode
            raise ValueError(
                f"async_scheduling needs one worker per instance and co-located instances "
                f"(got tensor_parallel_size={self.tensor_parallel_size}, "
                f"pipeline_parallel_size={self.pipeline_parallel_size}, "
                f"prefill_instances={p})"
            )
        if self.pipeline_parallel_size > 1 and self.scheduler.tbt_slo:
            # the adaptive budget models a whole iteration's time from its plan's start to
            # its result; with micro-batches in flight that span includes queueing behind
            # the other stages, so its predictions would not mean what the target means
            raise ValueError(
                f"tbt_slo={self.scheduler.tbt_slo} needs pipeline_parallel_size=1 (got "
                f"{self.pipeline_parallel_size}): the adaptive budget does not model pipelines"
            )

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0

    @property
    def num_instances(self) -> int:
        """Engine instances: the prefill and decode ones, else the replicas."""
        if self.disaggregated:
            return self.prefill_instances + self.decode_instances
        return self.data_parallel_size

    def instance_role(self, instance: int) -> str:
        """ "mixed" (co-located), or "prefill" for the first prefill_instances instances
        and "decode" for the others."""
        if not self.disaggregated:
            return "mixed"
        return "prefill" if instance < self.prefill_instances else "decode"

    def with_policy(self, policy: str, chunk_size: int | None = None) -> EngineConfig:
        """The same engine under another policy (and chunk size): what a comparison or a
        sweep point runs. A TBT target (and its latency profile) is kept for sarathi only,
        the one policy with a budget to adapt."""
        tbt = self.scheduler.tbt_slo if policy == "sarathi" else 0.0
        sched = dataclasses.replace(
            self.scheduler,
            policy=policy,
            chunk_size=self.scheduler.chunk_size if chunk_size is None else chunk_size,
            tbt_slo=tbt,
            latency_profile=self.scheduler.latency_profile if tbt else "",
        )
        return dataclasses.replace(self, scheduler=sched)


@dataclass(frozen=True)
class CurveKeys:
    """The server's CurveZMQ keypair (z85 text), when the public endpoint requires it."""

    public: str
    secret: str = field(repr=False)


@dataclass(frozen=True)
class DeploymentConfig:
    """How a multi-process deployment runs (the engine itself is an `EngineConfig`).

    endpoint: the public endpoint (ipc://PATH or tcp://HOST:PORT); None = an ipc socket
        in the deployment's private 0700 run directory.
    num_detokenizers: detokenizer processes (requests are sharded over them).
    curve: the server's CurveZMQ keys; required for a non-loopback tcp endpoint.
    restart: "no" (a dead process stops the deployment) or "on-failure" (it is started
        again on the same endpoint, at most max_restarts times). With several engine
        instances (replicas, prefill/decode) a dead instance's processes stop alone: with
        "no" it stays down while the others serve (the deployment stops once none is up),
        with "on-failure" it restarts alone (max_restarts times each).
    drain_timeout: on stop, seconds in-flight requests get to finish before being aborted.
    client_timeout / max_client_backlog: the frontend's limits on a client that stops
        answering heartbeats / stops reading its output (its requests are then aborted).
    ready_timeout: seconds every process gets to report READY.
    log_level: the children's logging level; log_file: where their output goes
        (appended; None: inherited).
    http_port: serve the OpenAI-compatible HTTP API on this port (None: no HTTP server);
        http_host: its address (a non-loopback one needs api_key); api_key: the bearer key
        its /v1/ routes require; max_body_mb: the largest request body it reads.
    nnodes / node_rank / master_addr / master_port: a deployment over several machines
        (docs/MULTINODE.md). Node 0 (the head) runs the frontend, scheduler, detokenizers
        and its share of the workers; node r > 0 runs only its workers, which join the
        head. The workers (tp x pp ranks) are split evenly, node r hosting a contiguous
        block. master_addr:master_port is torch.distributed's TCP rendezvous (the head's
        rank 0 hosts it); master_port + 1 is the node link (join, heartbeats, plans and
        results), CurveZMQ-encrypted with `curve` (required unless master_addr is
        loopback). Every node gets the same keys, which authenticate the nodes too.
    """

    endpoint: str | None = None
    num_detokenizers: int = 1
    curve: CurveKeys | None = None
    restart: str = "no"
    max_restarts: int = 3
    drain_timeout: float = 30.0
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S
    max_client_backlog: int = 10_000
    ready_timeout: float = 600.0
    log_level: str = "WARNING"
    log_file: str | None = None
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    max_body_mb: float = 4.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, Any]] = [
            (self.nnodes >= 1, "nnodes", ">= 1"),
            (0 <= self.node_rank < self.nnodes, "node_rank", f"in [0, nnodes={self.nnodes})"),
            (bool(self.master_addr.strip()), "master_addr", "a host name or address"),
            # master_port + 1 is the node link
            (1 <= self.master_port <= 65534, "master_port", "in [1, 65534]"),
            (self.http_port is None or 0 <= self.http_port < 65536, "http_port", "in [0, 65535]"),
            (self.max_body_mb > 0, "max_body_mb", "> 0"),
            (self.num_detokenizers >= 1, "num_detokenizers", ">= 1"),
            (self.restart in RESTART_POLICIES, "restart", f"one of {RESTART_POLICIES}"),
            (self.max_restarts >= 0, "max_restarts", ">= 0"),
            (self.drain_timeout >= 0, "drain_timeout", ">= 0"),
            (self.client_timeout > 0, "client_timeout", "> 0"),
            (self.max_client_backlog >= 1, "max_client_backlog", ">= 1"),
            (self.ready_timeout > 0, "ready_timeout", "> 0"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be {allowed}")
