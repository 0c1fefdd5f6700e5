"""The offline `LLM` API on the real default model: bad input, sampling, stops, preemption."""

from __future__ import annotations

import pytest
import torch

from sarazmq import LLM, SamplingParams
from sarazmq.config import SchedulerConfig

pytestmark = [pytest.mark.model]

PROMPTS = [
    "The capital of France is",
    "Write a short poem about autumn leaves falling.",
    "def add(a, b):",
    "In 1969, the first humans",
    "A list of fruits: apple, banana,",
    "The mitochondria is the",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 and the float GGUF matmuls: tests below compare outputs across batchings,
    # which bf16 or int8 roundings follow
    return LLM(
        chunk_size=32,
        max_num_seqs=16,
        max_model_len=512,
        num_kv_blocks=256,
        dtype="float32",
        gguf_matmul="float",
    )


def test_unknown_model_and_policy_are_clear_errors() -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="unknown scheduler policy 'fifo'"):
        LLM(scheduler="fifo")


def test_per_request_errors_leave_others_untouched(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate(PROMPTS[:2], greedy)
    outs = llm.generate([PROMPTS[0], "", list(range(5, 600)), [1, 2, 10**9], PROMPTS[1]], greedy)
    assert [o.finish_reason for o in outs] == [
        alone[0].finish_reason,
        "error",
        "error",
        "error",
        alone[1].finish_reason,
    ]
    assert "empty" in outs[1].error
    assert "context" in outs[2].error
    assert "token ids" in outs[3].error
    assert outs[0].token_ids == alone[0].token_ids and outs[4].token_ids == alone[1].token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", 0),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("logprobs", 99),
    ],
)
def test_out_of_range_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].token_ids
    mixed = llm.generate(
        [PROMPTS[3], PROMPTS[1], PROMPTS[0]],
        [
            SamplingParams(temperature=1.0, max_tokens=20),
            p,
            SamplingParams(temperature=0, max_tokens=5),
        ],
    )[1].token_ids
    assert alone == mixed
    other_seed = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True),
    )[0].token_ids
    assert other_seed != alone


def test_stop_strings_and_stop_ids_finish_with_stop(llm: LLM) -> None:
    base = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    stop = base.text[5:9]
    # ignore_eos in every run: on a raw (non-chat) prompt this model emits EOS first
    out = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text
    stop_id = base.token_ids[3]
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    # the engine is idle and every block is back
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_preemption_is_invisible(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]
    config = SchedulerConfig(chunk_size=64, max_num_seqs=16, max_model_len=512, watermark=0.0)
    llm.engine.replace_scheduler(config)
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.stats().num_preemptions == 0
    # 6 requests of ~60-90 tokens need ~40 blocks of 16 at the end: 16 blocks force preemption
    llm.engine.replace_scheduler(config, num_blocks=16)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(o.num_preemptions for o in outs) > 0
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 16
    llm.engine.replace_scheduler(SchedulerConfig(chunk_size=32, max_num_seqs=16, max_model_len=512))


def test_enforce_eager_runs_op_by_op_with_the_same_tokens(llm: LLM) -> None:
    # the fused one-call decode step (default) against the op-by-op model: 1-3 running
    # decodes run the very same kernels, so greedy tokens are identical
    assert llm.engine.runner.model.fused_decode
    eager = LLM(
        max_num_seqs=16,
        max_model_len=512,
        num_kv_blocks=64,
        enforce_eager=True,
        dtype="float32",
        gguf_matmul="float",
    )
    assert eager.engine.runner.model.fused_decode is False
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for batch in ([PROMPTS[0]], PROMPTS[1:4]):
        assert [o.token_ids for o in eager.generate(batch, params)] == [
            o.token_ids for o in llm.generate(batch, params)
        ]


def test_auto_dtype_is_bf16_exactly_where_the_hardware_has_it(monkeypatch) -> None:  # noqa: ANN001
    import sarazmq.resolve as resolve

    assert resolve.resolve_dtype("float16", "cpu") == "float16"
    for flags, want in (
        ({"amx_bf16"}, "bfloat16"),
        ({"avx512_bf16"}, "bfloat16"),
        (set(), "float32"),
    ):
        monkeypatch.setattr(resolve, "cpu_has_flag", lambda f, flags=flags: f in flags)
        assert resolve.resolve_dtype("auto", "cpu") == want
        assert resolve.resolve_dtype("float32", "cpu") == "float32"
    assert "auto" in resolve.describe_dtype_choice("auto", "float32")
    assert resolve.describe_dtype_choice("bfloat16", "bfloat16") == "dtype bfloat16"


def test_auto_gguf_matmul_is_int8_exactly_where_it_was_measured_faster(monkeypatch) -> None:  # noqa: ANN001
    import dataclasses

    import sarazmq.resolve as resolve
    from sarazmq.config import EngineConfig

    monkeypatch.setattr(resolve, "int8_dot_avx2", lambda: True)
    monkeypatch.setattr(resolve, "int8_dot_vnni", lambda: False)
    monkeypatch.setattr(resolve, "cpu_has_flag", lambda f: False)  # AVX2, no AVX-512
    assert resolve.resolve_gguf_matmul("auto", "gguf", "cpu", "float32") == "int8"
    for kind, device, dtype in (
        ("hf", "cpu", "float32"),  # safetensors: no blocks
        ("gguf", "cpu", "bfloat16"),
        ("gguf", "cuda", "float32"),
    ):
        assert resolve.resolve_gguf_matmul("auto", kind, device, dtype) == "float"
    # explicit choices stay
    assert resolve.resolve_gguf_matmul("float", "gguf", "cpu", "float32") == "float"
    assert resolve.resolve_gguf_matmul("int8", "gguf", "cpu", "float32") == "int8"
    # asked for where nothing would take it: an error naming it, not a silent float path
    for kind, device, dtype in (
        ("hf", "cpu", "float32"),
        ("gguf", "cpu", "bfloat16"),
        ("gguf", "cuda", "float32"),
    ):
        with pytest.raises(ValueError, match=f"gguf_matmul='int8'.*{kind} model, dtype {dtype}"):
            resolve.resolve_gguf_matmul("int8", kind, device, dtype)
    monkeypatch.setattr(resolve, "cpu_has_flag", lambda f: f == "avx512f")
    assert resolve.resolve_gguf_matmul("auto", "gguf", "cpu", "float32") == "float"
    monkeypatch.setattr(resolve, "int8_dot_vnni", lambda: True)  # AVX-512 with VNNI
    assert resolve.resolve_gguf_matmul("auto", "gguf", "cpu", "float32") == "int8"
    assert resolve.resolve_gguf_matmul("auto", "gguf", "cpu", "bfloat16") == "float"
    monkeypatch.setattr(resolve, "int8_dot_vnni", lambda: False)
    monkeypatch.setattr(resolve, "cpu_has_flag", lambda f: False)
    monkeypatch.setattr(resolve, "int8_dot_avx2", lambda: False)  # portable build only
    assert resolve.resolve_gguf_matmul("auto", "gguf", "cpu", "float32") == "float"
    # the startup line says it, and how to turn it off
    asked = EngineConfig()
    done = dataclasses.replace(asked, dtype="float32", gguf_matmul="int8")
    line = resolve.describe_dtype(asked, done)
    assert "GGUF matmuls int8 (auto:" in line and "--gguf-matmul float" in line
    pinned = dataclasses.replace(asked, gguf_matmul="int8")
    assert resolve.describe_dtype(pinned, done).endswith("GGUF matmuls int8")
    assert "int8" not in resolve.describe_dtype(
        asked, dataclasses.replace(done, gguf_matmul="float")
    )


def test_the_resolved_config_names_a_concrete_dtype() -> None:
    from sarazmq.config import EngineConfig
    from sarazmq.resolve import native_bf16, resolve_engine_config

    assert EngineConfig().dtype == EngineConfig().gguf_matmul == "auto"
    resolved, _ = resolve_engine_config(EngineConfig())
    assert resolved.dtype == ("bfloat16" if native_bf16(resolved.device) else "float32")
    assert resolved.gguf_matmul in ("float", "int8")


def test_int8_kv_cache_keeps_the_greedy_outputs_nearly_unchanged(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    int8 = LLM(
        chunk_size=32,
        max_num_seqs=16,
        max_model_len=512,
        num_kv_blocks=256,
        dtype="float32",
        gguf_matmul="float",  # the cache's roundings alone
        kv_cache_dtype="int8",
    )
    k_cache, _ = int8.engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.int8  # rows of int8 values and their scale
    outs = int8.generate(PROMPTS, greedy)
    base = llm.generate(PROMPTS, greedy)
    # ~7 bits per cached value: the first tokens of (nearly) every prompt are the same
    same = sum(o.token_ids[:4] == b.token_ids[:4] for o, b in zip(outs, base, strict=True))
    assert same >= len(PROMPTS) - 1, [(o.token_ids, b.token_ids) for o, b in zip(outs, base)]
