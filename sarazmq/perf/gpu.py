"""Iteration latency on GPUs we do not have: Vidur's measured operator tables, or a roofline.

`GpuProfileModel` (A100 / H100 where Vidur profiled the architecture):
- the linear layers, norms, RoPE, activation and residual adds: Vidur's mlp.csv medians
  (ms per layer, by num_tokens and TP degree) interpolated in num_tokens, times the layers,
  plus the embedding once. The medians are used as measured: neighbouring rows wiggle by
  up to ~7 % (GEMM tile choices, noise), so time is monotone in tokens only over coarser
  steps;
- attention (not in the copied data): a model calibrated on the README's A100 Llama-2-7B
  anchor medians (`calibrate_attention`): decode = fixed + per sequence + KV bytes at an
  effective bandwidth; prefill = fixed + per token + causal FLOPs at an effective FLOP/s.
  Scaled to another GPU by its peak FLOP/s and bandwidth;
- the LM head (Vidur does not time it) and tensor-parallel all-reduces: a roofline;
- the CPU's per-iteration work: `cpu_overhead.cpu_overhead_s`.

Both also give `parts(shape)`: the same time split by where a pipeline runs it (first
stage, decoder layers, last stage; see `sarazmq.perf.pipeline`).

`RooflineModel` (any named GPU and architecture): per phase (linear layers, attention, LM
head), max(FLOPs / (peak * FLOPS_EFF), bytes / (bandwidth * BW_EFF)), plus the same
all-reduce and CPU terms.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sarazmq.perf.architectures import Architecture, Gpu, get_gpu
from sarazmq.perf.cost import ModelCost, kv_read_tokens
from sarazmq.perf.cpu_overhead import cpu_overhead_s, cpu_overhead_split_s
from sarazmq.perf.cpu_overhead import interp as _interp
from sarazmq.perf.pipeline import IterationParts
from sarazmq.perf.profiles import profiles_root
from sarazmq.scheduler import IterationShape, nnls

#: mlp.csv per (GPU, architecture); Meta-Llama-3-8B has Mistral-7B's layer shapes
VIDUR_MLP = {
    ("a100-80gb", "llama-2-7b"): "compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv",
    ("h100-sxm", "llama-2-7b"): "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv",
    ("a100-80gb", "llama-3-8b"): "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv",
    ("a100-80gb", "mistral-7b"): "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv",
}
MLP_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
#: roofline efficiencies: what Vidur's A100 Llama-2-7B GEMMs reach (QKV+O+MLP at 4096
#: tokens: ~70 % of the BF16 peak; at 1 token: ~75 % of the HBM bandwidth)
FLOPS_EFF = 0.7
BW_EFF = 0.75
#: one all-reduce's fixed latency over NVLink (Vidur's all_reduce.csv was not copied)
ALLREDUCE_LATENCY_S = 10e-6

# README anchors: A100, Llama-2-7B (32 heads x 128, MHA), fp16, ms per layer.
ANCHOR_GPU = "a100-80gb"
ANCHOR_HEAD_DIM, ANCHOR_HEADS, ANCHOR_ELEM = 128, 32, 2
#: (batch, kv_cache_size, ms) at TP1
DECODE_ANCHORS = (
    (1, 32, 0.009), (8, 32, 0.018), (32, 32, 0.048), (64, 32, 0.097), (80, 32, 0.120),
    (1, 2368, 0.036), (8, 2368, 0.245), (16, 2368, 0.389), (32, 2368, 0.726),
    (48, 2368, 1.076), (102, 2304, 1.999), (128, 2304, 2.418),
)  # fmt: skip
#: (chunk, kv_cache_size before the chunk, TP degree, ms)
PREFILL_ANCHORS = (
    (960, 0, 1, 0.244), (960, 512, 1, 0.297), (960, 1024, 1, 0.350), (960, 2048, 1, 0.471),
    (960, 3136, 1, 0.593), (992, 0, 1, 0.256), (3584, 0, 8, 0.379), (4096, 0, 8, 0.484),
)  # fmt: skip


def vidur_mlp_path(gpu: str, arch: str) -> Path | None:
    """The mlp.csv Vidur measured for this GPU and architecture, or None."""
    rel = VIDUR_MLP.get((get_gpu(gpu).name, arch))
    if rel is None:
        return None
    path = profiles_root() / "data" / "profiling" / rel
    return path if path.is_file() else None


@dataclass(frozen=True)
class AttentionCalibration:
    """Per-layer attention time on the anchor GPU; see `calibrate_attention`."""

    decode_fixed_s: float
    decode_per_seq_s: float
    decode_bw_eff: float  # fraction of the GPU's bandwidth the KV reads reach
    prefill_fixed_s: float
    prefill_per_token_width_s: float  # per token per q column (num_heads * head_dim)
    prefill_flops_eff: float  # fraction of the GPU's peak the causal FLOPs reach

    def decode_s(self, gpu: Gpu, num_seqs: int, kv_bytes: float) -> float:
        if num_seqs == 0:
            return 0.0
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * num_seqs
            + kv_bytes / (gpu.bandwidth * self.decode_bw_eff)
        )

    def prefill_s(self, gpu: Gpu, num_tokens: int, q_width: int, flops: float) -> float:
        if num_tokens == 0:
            return 0.0
        compute_scale = get_gpu(ANCHOR_GPU).peak_flops / gpu.peak_flops
        return (
            self.prefill_fixed_s
            + self.prefill_per_token_width_s * num_tokens * q_width * compute_scale
            + flops / (gpu.peak_flops * self.prefill_flops_eff)
        )


@functools.cache
def calibrate_attention() -> AttentionCalibration:
    """Fits the attention terms to the README's anchors (non-negative, relative error).

    Decode: t = a + b * batch + KV bytes / (bw * eff); the fit reaches eff ~0.89 and
    ~1 us per sequence, within ~25 % of every anchor. Prefill: the fixed term is the
    decode's (a launch); t = a + c * tokens * q_width + 4 * q_width * pairs / (peak * eff),
    within ~15 % at TP1 (eff ~0.37), ~50 % fast at TP8 (4 heads per GPU fill it badly)."""
    gpu = get_gpu(ANCHOR_GPU)
    kv_width = ANCHOR_HEADS * ANCHOR_HEAD_DIM
    rows = [(1.0, bs, bs * kv * 2 * kv_width * ANCHOR_ELEM) for bs, kv, _ in DECODE_ANCHORS]
    y = np.array([ms for *_, ms in DECODE_ANCHORS]) * 1e-3
    a, b, inv_bw = _fit(np.array(rows), y)
    fixed = float(a)
    rows, ys = [], []
    for q, start, tp, ms in PREFILL_ANCHORS:
        width = kv_width // tp
        pairs = q * start + q * (q + 1) // 2
        rows.append((q * width, 4.0 * width * pairs))
        ys.append(ms * 1e-3 - fixed)
    c, inv_flops = _fit(np.array(rows), np.array(ys))
    return AttentionCalibration(
        decode_fixed_s=fixed,
        decode_per_seq_s=float(b),
        decode_bw_eff=1.0 / (float(inv_bw) * gpu.bandwidth),
        prefill_fixed_s=fixed,
        prefill_per_token_width_s=float(c),
        prefill_flops_eff=1.0 / (float(inv_flops) * gpu.peak_flops),
    )


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / y
    scale = np.abs(x).max(axis=0)
    return nnls(x * w[:, None] / scale, y * w) / scale


def read_mlp_table(
    path: Path, tp: int
) -> tuple[dict[str, Any], list[int], list[float], list[float]]:
    """(the table's model keys, num_tokens, per-layer seconds of MLP_OPS summed, embedding
    seconds) at TP degree `tp`; rows repeated for a num_tokens are averaged."""
    sums: dict[int, list[tuple[float, float]]] = {}
    keys: dict[str, Any] = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            keys = {k: int(float(row[k])) for k in ("n_head", "n_kv_head", "n_embd",
                                                    "n_expanded_embd", "vocab_size")}  # fmt: skip
            layer = sum(float(row[f"time_stats.{op}.median"]) for op in MLP_OPS) * 1e-3
            emb = float(row["time_stats.emb.median"]) * 1e-3
            sums.setdefault(int(row["num_tokens"]), []).append((layer, emb))
    if not sums:
        raise ValueError(f"{path} has no rows for tensor parallel degree {tp}")
    tokens = sorted(sums)
    layer_s = [sum(v[0] for v in sums[t]) / len(sums[t]) for t in tokens]
    emb_s = [sum(v[1] for v in sums[t]) / len(sums[t]) for t in tokens]
    return keys, tokens, layer_s, emb_s


def allreduce_s(gpu: Gpu, arch: Architecture, tp: int, num_tokens: int, elem: int) -> float:
    """Two ring all-reduces of the hidden states per layer (after attention and the MLP)."""
    if tp == 1:
        return 0.0
    size = num_tokens * arch.hidden_size * elem
    one = ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * size / gpu.link_bandwidth
    return 2 * arch.num_layers * one


def _roofline(flops: float, nbytes: float, gpu: Gpu, flops_eff: float, bw_eff: float) -> float:
    return max(flops / (gpu.peak_flops * flops_eff), nbytes / (gpu.bandwidth * bw_eff))


@dataclass(frozen=True)
class GpuProfileModel:
    """A LatencyModel from Vidur's tables (see the module docstring); build with `load`."""

    gpu: Gpu
    arch: Architecture
    tp: int
    table_path: str
    tokens: tuple[int, ...]
    layer_s: tuple[float, ...]  # one decoder layer's linear layers, norms, RoPE, act, add
    emb_s: tuple[float, ...]
    attention: AttentionCalibration
    cost: ModelCost
    cpu_overhead: bool = True

    @classmethod
    def load(
        cls, gpu: str, arch: Architecture, tp: int = 1, cpu_overhead: bool = True
    ) -> GpuProfileModel:
        """ValueError where Vidur has no table for the pair or its shapes differ."""
        path = vidur_mlp_path(gpu, arch.name)
        if path is None:
            raise ValueError(f"no Vidur mlp.csv for --gpu {gpu} --arch {arch.name}")
        keys, tokens, layer_s, emb_s = read_mlp_table(path, tp)
        want = {
            "n_head": arch.num_heads,
            "n_kv_head": arch.num_kv_heads,
            "n_embd": arch.hidden_size,
            "n_expanded_embd": arch.intermediate_size,
        }
        wrong = [f"{k}={keys[k]} (arch {v})" for k, v in want.items() if keys[k] != v]
        if wrong:
            raise ValueError(f"{path} is not {arch.name}'s shape: {', '.join(wrong)}")
        return cls(
            gpu=get_gpu(gpu),
            arch=arch,
            tp=tp,
            table_path=str(path),
            tokens=tuple(tokens),
            layer_s=tuple(layer_s),
            emb_s=tuple(emb_s),
            attention=calibrate_attention(),
            cost=ModelCost.from_architecture(arch, ANCHOR_ELEM, tp),
            cpu_overhead=cpu_overhead,
        )

    def linear_seconds(self, num_tokens: int) -> float:
        """The table's part: layers x one layer's ops, plus the embedding once."""
        if num_tokens == 0:
            return 0.0
        layer = _interp(self.tokens, self.layer_s, num_tokens)
        return self.arch.num_layers * layer + _interp(self.tokens, self.emb_s, num_tokens)

    def attention_seconds(self, shape: IterationShape) -> float:
        c, att = self.cost, self.attention
        decode_bytes = shape.decode_context_tokens * 2 * c.kv_width * c.elem
        prefill_flops = 4.0 * c.q_width * shape.prefill_attention_pairs
        per_layer = att.decode_s(self.gpu, shape.num_decode_seqs, decode_bytes) + att.prefill_s(
            self.gpu, shape.num_prefill_tokens, c.q_width, prefill_flops
        )
        return c.num_layers * per_layer

    def predict(self, shape: IterationShape) -> float:
        n = shape.num_tokens
        if n == 0:
            return 0.0
        c = self.cost
        head = _roofline(
            c.head_flops(shape.num_sampled), c.head_params * c.elem, self.gpu, FLOPS_EFF, BW_EFF
        )
        t = self.linear_seconds(n) + self.attention_seconds(shape) + head
        t += allreduce_s(self.gpu, self.arch, self.tp, n, c.elem)
        if self.cpu_overhead:
            t += cpu_overhead_s(shape.num_seqs)
        return t

    def parts(self, shape: IterationShape) -> IterationParts:
        """`predict`'s terms by where a pipeline runs them: the embedding and the CPU's
        pre-forward work first, the decoder layers (with their all-reduces), then the LM
        head and the CPU's sampling and output work (sums to `predict` up to rounding)."""
        n = shape.num_tokens
        if n == 0:
            return IterationParts()
        c = self.cost
        head = _roofline(
            c.head_flops(shape.num_sampled), c.head_params * c.elem, self.gpu, FLOPS_EFF, BW_EFF
        )
        layer = _interp(self.tokens, self.layer_s, n)
        layers = self.arch.num_layers * layer + self.attention_seconds(shape)
        layers += allreduce_s(self.gpu, self.arch, self.tp, n, c.elem)
        pre, post = cpu_overhead_split_s(shape.num_seqs) if self.cpu_overhead else (0.0, 0.0)
        return IterationParts(
            first_s=_interp(self.tokens, self.emb_s, n) + pre,
            layers_s=layers,
            last_s=head + post,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "gpu_profile",
            "gpu": self.gpu.name,
            "arch": self.arch.name,
            "tp": self.tp,
            "mlp_table": self.table_path,
            "attention": asdict(self.attention),
            "cpu_overhead": "vidur cpu_overheads.csv" if self.cpu_overhead else "none",
        }


@dataclass(frozen=True)
class RooflineModel:
    """A LatencyModel for any named GPU and architecture (see the module docstring)."""

    gpu: Gpu
    arch: Architecture
    tp: int = 1
    elem: int = 2
    flops_eff: float = FLOPS_EFF
    bw_eff: float = BW_EFF
    cpu_overhead: bool = True

    @functools.cached_property
    def cost(self) -> ModelCost:
        return ModelCost.from_architecture(self.arch, self.elem, self.tp)

    def predict(self, shape: IterationShape) -> float:
        n = shape.num_tokens
        if n == 0:
            return 0.0
        c, g, fe, be = self.cost, self.gpu, self.flops_eff, self.bw_eff
        pairs = shape.prefill_attention_pairs + shape.decode_context_tokens
        kv_bytes = (kv_read_tokens(shape) + n) * c.kv_bytes_per_token
        t = _roofline(c.linear_flops(n), c.linear_params * c.elem, g, fe, be)
        t += _roofline(c.attention_flops(pairs), kv_bytes, g, fe, be)
        t += _roofline(c.head_flops(shape.num_sampled), c.head_params * c.elem, g, fe, be)
        t += allreduce_s(g, self.arch, self.tp, n, c.elem)
        if self.cpu_overhead:
            t += cpu_overhead_s(shape.num_seqs)
        return t

    def parts(self, shape: IterationShape) -> IterationParts:
        """`predict`'s terms by where a pipeline runs them: the CPU's pre-forward work
        first, the decoder layers (linear layers, attention, all-reduces), then the LM head
        and the CPU's sampling and output work (sums to `predict` up to rounding)."""
        n = shape.num_tokens
        if n == 0:
            return IterationParts()
        c, g, fe, be = self.cost, self.gpu, self.flops_eff, self.bw_eff
        pairs = shape.prefill_attention_pairs + shape.decode_context_tokens
        kv_bytes = (kv_read_tokens(shape) + n) * c.kv_bytes_per_token
        layers = _roofline(c.linear_flops(n), c.linear_params * c.elem, g, fe, be)
        layers += _roofline(c.attention_flops(pairs), kv_bytes, g, fe, be)
        layers += allreduce_s(g, self.arch, self.tp, n, c.elem)
        head = _roofline(c.head_flops(shape.num_sampled), c.head_params * c.elem, g, fe, be)
        pre, post = cpu_overhead_split_s(shape.num_seqs) if self.cpu_overhead else (0.0, 0.0)
        return IterationParts(first_s=pre, layers_s=layers, last_s=head + post)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "roofline",
            "gpu": self.gpu.name,
            "arch": self.arch.name,
            "tp": self.tp,
            "flops_eff": self.flops_eff,
            "bw_eff": self.bw_eff,
            "peak_flops": self.gpu.peak_flops,
            "bandwidth": self.gpu.bandwidth,
            "cpu_overhead": "vidur cpu_overheads.csv" if self.cpu_overhead else "none",
        }
