"""Tiny random-weight models, for tests and benchmarks where the real model is not the
point: the process machinery, the scheduler, the transport, the host's share of a step
(scripts/bench_async.py). They load and run in a fraction of the default model's time,
with its tokenizer and chat template (prompts and texts stay meaningful)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_llama(out: Path, **overrides: int | float) -> str:
    """A random-weight Llama folder (safetensors + config) with the default model's
    tokenizer, at `out`; the path as a string. `overrides` replace LlamaConfig fields
    (the default: 2 layers, hidden 64, 8 heads and 4 KV heads, so tp 2 and tp 4 fit)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sarazmq.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    torch.manual_seed(0)
    fields: dict[str, int | float] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,  # varied greedy outputs (the default repeats one token)
        **overrides,
    }
    cfg = LlamaConfig(
        vocab_size=len(tok),
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **fields,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
