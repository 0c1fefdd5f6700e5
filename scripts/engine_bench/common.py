"""Shapes, timing and machine limits shared by the engine benchmark's parts."""

from __future__ import annotations

import torch

# median_time and time_once are the package's, re-exported for the benchmark's parts
from sarazmq.perf.machine import median_time as median_time
from sarazmq.perf.machine import probe_machine
from sarazmq.perf.machine import time_once as time_once

PROMPT_LEN = 2048
PREFILL_CHUNK = 512
DECODE_CTX = 512
DECODE_BATCHES = (1, 16, 64)
# decode batches for the fused-step A/B, those the model's fused step takes (up to 8
# sequences in bf16, 6 in float32; 16 and 32 where the model reads a GGUF's blocks)
EAGER_AB_BATCHES = (1, 4, 8, 16, 32)
# decode batches the --int8 rows measure (issue 38's goals: 16 and 64 running)
INT8_DECODE_BATCHES = (16, 64)
HYBRID_CHUNK = 256
HYBRID_DECODES = 32


def measure_machine(dtype: torch.dtype, quick: bool) -> tuple[float, float]:
    """(GEMM peak FLOP/s in `dtype`, memory read bandwidth bytes/s): the package's probe."""
    probe = probe_machine(dtype, quick)
    return probe.gemm_flops, probe.bandwidth_bytes_s
