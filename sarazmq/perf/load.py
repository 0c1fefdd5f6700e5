"""One way to get a latency model: from a measured profile, or from a named GPU and model."""

from __future__ import annotations

from typing import Any

from sarazmq.perf.architectures import get_architecture, get_gpu
from sarazmq.perf.gpu import GpuProfileModel, RooflineModel, vidur_mlp_path
from sarazmq.perf.pipeline import DEFAULT_PP_LINK_BANDWIDTH, PipelineLatency
from sarazmq.scheduler import KIND, LatencyModel, profile_model


def load_latency_model(
    profile: str | None,
    gpu: str | None,
    arch: str | None,
    tp: int = 1,
    pp: int = 1,
    pp_link_bandwidth: float = DEFAULT_PP_LINK_BANDWIDTH,
) -> tuple[LatencyModel, dict[str, Any]]:
    """The latency model of a profile JSON (`profile`), or of a GPU and architecture by
    name (Vidur's measured tables where it has them, else a roofline); and a description
    of where it came from (for a run's summary). ValueError naming the flag on a bad
    combination or name.

    pp > 1 (GPU and architecture only): a `PipelineLatency` of pp stages over the TP-`tp`
    model, stages linked at `pp_link_bandwidth` bytes/s; pp = 1 returns the plain model."""
    if profile is not None and (gpu is not None or arch is not None):
        raise ValueError("give --profile, or --gpu and --arch, not both")
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    if pp < 1:
        raise ValueError(f"--pp {pp} must be >= 1")
    if not pp_link_bandwidth > 0:
        raise ValueError(f"--pp-link-gbs must be > 0 (got {pp_link_bandwidth / 1e9} GB/s)")
    if profile is not None:
        if tp != 1:
            raise ValueError("--tp applies to --gpu/--arch; a --profile was measured as it ran")
        if pp != 1:
            raise ValueError("--pp applies to --gpu/--arch; a --profile was measured as it ran")
        model, data = profile_model(profile)
        info = {
            "source": "profile",
            "path": profile,
            "kind": data.get("kind", KIND),
            "model": model.to_dict(),
        }
        for key in ("engine", "machine", "error", "overhead_s", "runs"):
            if key in data:
                info[key] = data[key]
        return model, info
    if gpu is None or arch is None:
        missing = "--gpu" if gpu is None else "--arch"
        raise ValueError(f"give --profile, or both --gpu and --arch ({missing} is missing)")
    try:
        g = get_gpu(gpu)
    except ValueError as e:
        raise ValueError(f"--gpu: {e}") from None
    try:
        a = get_architecture(arch)
    except ValueError as e:
        raise ValueError(f"--arch: {e}") from None
    if a.num_kv_heads % tp and tp % a.num_kv_heads:
        raise ValueError(f"--tp {tp} does not split {a.name}'s {a.num_kv_heads} KV heads")
    if pp > a.num_layers:
        raise ValueError(f"--pp {pp} is more stages than {a.name}'s {a.num_layers} layers")
    why = f"no Vidur table for {g.name} + {a.name}"
    base: LatencyModel | None = None
    info: dict[str, Any] = {}
    if vidur_mlp_path(g.name, a.name) is not None:
        try:
            gm = GpuProfileModel.load(g.name, a, tp)
        except ValueError as e:  # e.g. a TP degree the table lacks
            why = str(e)
        else:
            base, info = gm, {"source": "vidur", **gm.describe()}
    if base is None:
        rm = RooflineModel(g, a, tp)
        base, info = rm, {"source": "roofline", "why": why, **rm.describe()}
    if pp == 1:
        return base, info
    pipe = PipelineLatency(base, pp, a.num_layers, a.hidden_size, link_bandwidth=pp_link_bandwidth)
    return pipe, {**info, "pipeline": pipe.describe()}
