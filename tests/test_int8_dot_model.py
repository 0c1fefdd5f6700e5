"""The default GGUF model with `gguf_matmul="int8"` (llama.cpp-style integer dot products on
its Q4_1 blocks, sarazmq.kernels.int8_dot; the default, "auto", where the CPU is AVX2
without AVX-512): its greedy streams part from the float path's only at near ties, its
next-token distributions stay close, and the option is validated."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from sarazmq import LLM, SamplingParams
from sarazmq.cli import main
from sarazmq.cli.options import engine_config
from sarazmq.config import EngineConfig
from sarazmq.kernels import TorchPagedAttention
from sarazmq.kernels.int8_dot import int8_dot_available
from sarazmq.model.loader import load_model, load_model_config, load_tokenizer, resolve_model
from sarazmq.options import EngineOptions, option_flags
from sarazmq.perf.token_agreement import pooled, teacher_forced_logits

pytestmark = pytest.mark.one_torch_thread


PROMPTS = [
    "The capital of France is",
    "Write a short poem about autumn leaves falling.",
    "def add(a, b):",
    "In 1969, the first humans",
    "A list of fruits: apple, banana,",
    "The mitochondria is the",
]


def test_option_and_config() -> None:
    assert EngineOptions().gguf_matmul == "auto" == EngineConfig().gguf_matmul
    assert EngineOptions(gguf_matmul="int8").to_config().gguf_matmul == "int8"
    flags = {flag.name: flag for _, flag in option_flags()}
    assert flags["--gguf-matmul"].choices == ("auto", "float", "int8")
    with pytest.raises(ValueError, match="gguf_matmul"):
        EngineOptions(gguf_matmul="int4").to_config()
    assert engine_config({"gguf_matmul": "int8"}).gguf_matmul == "int8"
    r = CliRunner().invoke(main, ["serve", "--gguf-matmul", "int4"])
    assert r.exit_code == 2 and "'--gguf-matmul'" in r.output and "int4" in r.output


# int8 logits differ from float32 ones by up to ~1 logit on this model (teacher-forced, all
# matmuls int8), so greedy streams may part where the float path's top two are closer
NEAR_TIE_NATS = 1.0


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy streams differ (None: they never do)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.model
@pytest.mark.skipif(not int8_dot_available(), reason="no C compiler")
def test_int8_greedy_streams_part_from_float_only_at_near_ties() -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for mode in ("float", "int8"):
        llm = LLM(
            dtype="float32",
            max_model_len=512,
            num_kv_blocks=256,
            max_num_seqs=8,
            num_threads=1,
            gguf_matmul=mode,
        )
        runs[mode] = llm.generate(PROMPTS, greedy)
        del llm
    parted = 0
    for f, i in zip(runs["float"], runs["int8"], strict=True):
        at = _first_difference(f.token_ids, i.token_ids)
        if at is None:
            continue
        parted += 1
        top = f.logprobs[at]
        assert top is not None and len(top.top_logprobs) == 2, top
        gap = top.top_logprobs[0] - top.top_logprobs[1]
        print(f"parted at {at}/{len(f.token_ids)}: float's top-2 gap {gap:.3f} nats")
        # where the float path was sure, int8 picks the same token
        assert gap < NEAR_TIE_NATS, (at, gap, f.token_ids, i.token_ids)
    print(f"int8 vs float greedy: {parted}/{len(PROMPTS)} streams parted")
    assert parted < len(PROMPTS)


@pytest.mark.model
@pytest.mark.skipif(not int8_dot_available(), reason="no C compiler")
def test_int8_next_token_distributions_stay_close_to_float() -> None:
    # scripts/accuracy_gguf.py measures this over 726 positions (docs/KERNELS.md): top-1
    # agreement 0.977, mean KL 0.0032 nats, llama.cpp on the same file 0.974 / 0.0032
    source = resolve_model("smollm2-135m-instruct")
    model = load_model(
        source, load_model_config(source), torch.float32, "cpu", TorchPagedAttention()
    )
    tokenizer = load_tokenizer(source)
    texts = [tokenizer.encode(" ".join(PROMPTS)), tokenizer.encode(PROMPTS[1] * 4)]
    assert model.set_gguf_matmul("float") == 0
    reference = [teacher_forced_logits(model, ids, chunk=64) for ids in texts]
    assert model.set_gguf_matmul("int8") > 0
    int8 = [teacher_forced_logits(model, ids, chunk=64) for ids in texts]
    a = pooled(list(zip(reference, int8, texts, strict=True)))
    print(f"int8 vs float32: {a}")
    assert a.top1_agreement >= 0.9 and a.mean_kl < 0.02, a
    assert 0 < a.max_kl < 0.5, a  # it is not the float path, and not far from it


@pytest.mark.model
@pytest.mark.skipif(not int8_dot_available(), reason="no C compiler")
def test_int8_engine_frees_the_float_copies_and_float_rebuilds_them() -> None:
    """An engine with int8 GGUF matmuls keeps no float copy the int8 kernels do not read
    (the packed float32 matmuls were most of its weight memory); switching the model to
    "float" rebuilds them from the blocks: the float engine's exact outputs, and back."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, num_threads=1)
    reference = LLM(gguf_matmul="float", **kwargs)
    float_outs = reference.generate(PROMPTS[:3], greedy)
    float_bytes = reference.engine.runner.model.weight_bytes()
    del reference
    llm = LLM(gguf_matmul="int8", **kwargs)
    model = llm.engine.runner.model
    held = model.weight_bytes()
    assert held["packed"] == 0 and held["int8_panels"] > 0
    assert held["plain"] < float_bytes["plain"] + float_bytes["packed"] // 4
    for name, w in model.matmul_weights():
        assert w.int8_blocks and w.float_released, name
        assert w.has_plain == w.keep_plain, name  # only the tied embedding stays
    int8_outs = llm.generate(PROMPTS[:3], greedy)

    def same(a: list, b: list) -> bool:
        return [(o.token_ids, o.logprobs) for o in a] == [(o.token_ids, o.logprobs) for o in b]

    model.set_gguf_matmul("float")
    assert model.weight_bytes() == float_bytes
    assert same(llm.generate(PROMPTS[:3], greedy), float_outs)
    # int8 again: the same as before, with the float copies kept or released
    model.set_gguf_matmul("int8")
    assert same(llm.generate(PROMPTS[:3], greedy), int8_outs)
    model.set_gguf_matmul("int8", release_float_copies=True)
    assert model.weight_bytes() == held
    assert same(llm.generate(PROMPTS[:3], greedy), int8_outs)
