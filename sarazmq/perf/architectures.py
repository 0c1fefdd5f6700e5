"""Named GPUs, and the named model architectures (`sarazmq.model.architectures`), for
latency models of hardware we do not have.

The GPU numbers are the vendors' dense (no sparsity) BF16 tensor-core peaks and HBM
bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarazmq.model.architectures import ARCHITECTURES, Architecture, get_architecture

__all__ = ["ARCHITECTURES", "GPUS", "Architecture", "Gpu", "get_architecture", "get_gpu"]


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


def get_gpu(name: str) -> Gpu:
    """The named GPU (aliases: a100, h100), or a ValueError listing the known ones."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join([*GPUS, *GPU_ALIASES])
        raise ValueError(f"unknown GPU {name!r}; known: {known}")
    return GPUS[key]
