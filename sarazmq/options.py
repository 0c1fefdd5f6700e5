"""The one front door for an engine's configuration: `EngineOptions`.

Every way of configuring an engine goes through this dataclass of flat options:
`LLM(**options)`, every command's flags (the click options are generated from these
fields, `sarazmq.cli.options`), the simulator (`sarazmq.sim.run`) and the scripts.
`EngineOptions.to_config()` is the only constructor of `EngineConfig` in the library;
everything after it (resolving "auto" and sizes, `sarazmq.resolve`) only replaces fields
of the config it returns.

Defaults are the config dataclasses' own (one source). Each field's metadata says how it appears on the command line (`Flag`): its flag, help,
choices, and whether the simulating commands take it (`sim`), so a new option is added
once, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sarazmq.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    GGUF_MATMULS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POLICIES,
    ROUTER_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)


@dataclass(frozen=True)
class Flag:
    """How an option appears on the command line.

    name: the flag (e.g. "--chunk-size"); a boolean with `negative` is a switch pair
        ("--prefix-caching/--no-prefix-caching"), one without is a plain flag.
    help: the help text; sim_help: the text a simulating command shows instead, where the
        option means something else there (e.g. 0 = derived from the GPU).
    choices: the allowed values (a click.Choice).
    sim: whether the simulating commands (`simulate`, `capacity --simulate`, ...) take it.
    """

    name: str
    help: str = ""
    choices: tuple[str, ...] = ()
    negative: str = ""
    sim: bool = False
    sim_help: str = ""


def _option(default: Any, flag: Flag | None = None) -> Any:
    """A dataclass field with its command-line flag (None: Python-only)."""
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class EngineOptions:
    """The flat options of an engine (see the module docstring). Field order is the
    order of the flags in `--help`."""

    model: str = _option(
        EngineConfig.model, Flag("--model", "model name, .gguf file, or Hugging Face folder")
    )
    load_format: str = _option(
        EngineConfig.load_format,
        Flag(
            "--load-format",
            "auto: the model's weights; dummy: random weights of its shapes, to measure speed "
            "at real sizes without a checkpoint (--model may then name an architecture: "
            "llama-2-7b, llama-3-8b, mistral-7b, smollm2-135m, ...)",
            LOAD_FORMATS,
        ),
    )
    scheduler: str = _option(
        SchedulerConfig.policy, Flag("--scheduler", "batching policy", POLICIES, sim=True)
    )
    chunk_size: int = _option(
        SchedulerConfig.chunk_size, Flag("--chunk-size", "per-iteration token budget", sim=True)
    )
    max_num_seqs: int = _option(
        SchedulerConfig.max_num_seqs,
        Flag("--max-num-seqs", "most requests running at once", sim=True),
    )
    tbt_slo: float = _option(
        SchedulerConfig.tbt_slo,
        Flag(
            "--tbt-slo",
            "time-between-tokens target (s): each iteration's chunk is the largest whose "
            "predicted time fits the decodes' slack; --chunk-size is its upper bound "
            "(sarathi; 0 = fixed chunk; calibrated at startup)",
            sim=True,
        ),
    )
    block_size: int = _option(
        CacheConfig.block_size, Flag("--block-size", "tokens per KV block", sim=True)
    )
    enable_prefix_caching: bool = _option(
        CacheConfig.enable_prefix_caching,
        Flag(
            "--prefix-caching",
            "reuse the KV of shared prompt prefixes (whole blocks)",
            negative="--no-prefix-caching",
            sim=True,
        ),
    )
    tensor_parallel_size: int = _option(
        EngineConfig.tensor_parallel_size,
        Flag("--tp", "tensor-parallel workers", sim=True, sim_help="GPUs per model"),
    )
    pipeline_parallel_size: int = _option(
        EngineConfig.pipeline_parallel_size,
        Flag(
            "--pp",
            "pipeline stages (the layers split evenly; tp x pp workers in all)",
            sim=True,
            sim_help="pipeline stages (with --gpu/--arch: the layers split evenly, tp x pp GPUs)",
        ),
    )
    data_parallel_size: int = _option(
        EngineConfig.data_parallel_size,
        Flag(
            "--dp",
            "data-parallel replicas: independent engine instances (tp x pp workers each) "
            "behind one frontend and API",
            sim=True,
            sim_help="data-parallel replicas simulated behind one router (a fleet)",
        ),
    )
    router: str = _option(
        EngineConfig.router,
        Flag(
            "--router",
            "how requests are spread over --dp replicas: round-robin; least-load (shortest "
            "expected prefill wait, KV use); cache-aware (least-load, counting the prompt "
            "blocks a replica was recently sent as cached, within a load bound)",
            ROUTER_POLICIES,
            sim=True,
        ),
    )
    disaggregate: bool = _option(
        False,
        Flag(
            "--disaggregate",
            "prefill and decode on separate instances (--prefill-instances, "
            "--decode-instances): the prompt's KV moves between them after its first token",
        ),
    )
    prefill_instances: int = _option(
        1, Flag("--prefill-instances", "with --disaggregate: instances that compute prompts")
    )
    decode_instances: int = _option(
        1, Flag("--decode-instances", "with --disaggregate: instances that decode")
    )
    dtype: str = _option(
        EngineConfig.dtype,
        Flag(
            "--dtype",
            "auto: bfloat16 where the hardware computes it natively (AMX or AVX512-BF16 CPUs, "
            "CUDA GPUs with bf16), else float32",
            DTYPES,
        ),
    )
    kv_cache_dtype: str = _option(
        CacheConfig.kv_cache_dtype,
        Flag(
            "--kv-cache-dtype",
            "auto: the model's dtype; int8: 0.53x the bytes of bf16 and 0.27x those of "
            "float32 per cached token (more tokens in the pool, less for decode attention to "
            "read; ~7 bits of precision per row)",
            KV_CACHE_DTYPES,
        ),
    )
    gguf_matmul: str = _option(
        EngineConfig.gguf_matmul,
        Flag(
            "--gguf-matmul",
            "matmuls on a GGUF model's Q4_0/Q4_1/Q8_0 blocks (CPU, float32): float rebuilds "
            "the float32 weights (bitwise the dequantized model); int8 quantizes activations "
            "per 32-block and takes integer dot products (llama.cpp's precision, ~1.5-2x "
            "faster on AVX2); auto: int8 on AVX2 CPUs without AVX-512, else float",
            GGUF_MATMULS,
        ),
    )
    num_kv_blocks: int = _option(
        CacheConfig.num_blocks,
        Flag(
            "--num-kv-blocks",
            "KV pool size in blocks (0 = from available memory)",
            sim=True,
            sim_help="KV pool size in blocks (0 = the profile's engine pool, or GPU memory "
            "minus weights)",
        ),
    )
    max_model_len: int = _option(
        SchedulerConfig.max_model_len,
        Flag(
            "--max-model-len",
            "longest prompt+output (0 = the model's context)",
            sim=True,
            sim_help="longest prompt+output (0 = the profiled model's context, else the "
            "workload's longest)",
        ),
    )
    attention_backend: str = _option(
        EngineConfig.attention_backend,
        Flag(
            "--attention-backend",
            "auto: flash_attn where it imports on CUDA, else triton on CUDA, else the native "
            "CPU kernels, else torch",
            ATTENTION_BACKENDS,
        ),
    )
    enforce_eager: bool = _option(
        EngineConfig.enforce_eager,
        Flag(
            "--enforce-eager",
            "run the model op by op (no fused one-call decode step, no CUDA graphs)",
        ),
    )
    cuda_graph_max_batch: int = _option(
        EngineConfig.cuda_graph_max_batch,
        Flag(
            "--cuda-graph-max-batch",
            "decode batches up to this size replay captured CUDA graphs (CUDA with the "
            "triton attention backend; 0 = never)",
        ),
    )
    async_scheduling: bool = _option(
        EngineConfig.async_scheduling,
        Flag(
            "--async-scheduling",
            "build the next batch while the worker runs this one (vLLM's asynchronous "
            "scheduling; one worker: no --tp/--pp, not --disaggregate)",
        ),
    )
    device: str = _option(
        EngineConfig.device, Flag("--device", "auto: cuda when available, else cpu")
    )
    num_threads: int = _option(
        EngineConfig.num_threads, Flag("--threads", "torch threads per worker (0 = cores / tp)")
    )
    latency_profile: str = _option(
        SchedulerConfig.latency_profile,
        Flag(
            "--latency-profile",
            "with --tbt-slo: a `sarazmq profile` JSON to seed the latency model (default: "
            "calibrate at startup)",
        ),
    )
    max_waiting: int = _option(
        SchedulerConfig.max_waiting,
        Flag(
            "--max-waiting",
            "refuse new requests (overloaded; HTTP 503) while this many wait (0 = no limit)",
        ),
    )
    seed: int = _option(
        EngineConfig.seed,
        Flag(
            "--seed",
            "the run's seed: per-request sampling seeds drawn by the engine (and, for "
            "replay, the workload)",
            sim=True,
            sim_help="workload and engine seed",
        ),
    )
    #: fraction of KV blocks kept free at admission (Python only)
    watermark: float = _option(SchedulerConfig.watermark)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], **overrides: Any) -> EngineOptions:
        """The options among `values` (a command's whole option dict may be passed: keys
        that are not options are ignored), `overrides` winning."""
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in values.items() if k in names}
        picked.update(overrides)
        return cls(**picked)

    def to_config(self) -> EngineConfig:
        """The engine config of these options; ValueError naming a bad value. The only
        construction of `EngineConfig` (see the module docstring)."""
        return EngineConfig(
            model=self.model,
            load_format=self.load_format,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cuda_graph_max_batch=self.cuda_graph_max_batch,
            async_scheduling=self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            router=self.router,
            prefill_instances=self.prefill_instances if self.disaggregate else 0,
            decode_instances=self.decode_instances if self.disaggregate else 0,
            num_threads=self.num_threads,
            seed=self.seed,
            gguf_matmul=self.gguf_matmul,
            scheduler=SchedulerConfig(
                policy=self.scheduler,
                chunk_size=self.chunk_size,
                max_num_seqs=self.max_num_seqs,
                watermark=self.watermark,
                max_model_len=self.max_model_len,
                max_waiting=self.max_waiting,
                tbt_slo=self.tbt_slo,
                latency_profile=self.latency_profile,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
        )


def option_flags(*, sim_only: bool = False) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """(field, flag) of every option with a flag, in `--help` order; sim_only: only those
    the simulating commands take."""
    out = []
    for f in dataclasses.fields(EngineOptions):
        flag = f.metadata.get("flag")
        if flag is not None and (flag.sim or not sim_only):
            out.append((f, flag))
    return out
