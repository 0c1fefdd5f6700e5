"""`--load-format dummy`: random weights of a file's or a named architecture's shapes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sarazmq import LLM, SamplingParams
from sarazmq.cli import main as cli_main
from sarazmq.model.architectures import ARCHITECTURES, get_architecture
from sarazmq.model.loader import load_model_config, load_tokenizer, resolve_model
from sarazmq.options import EngineOptions
from sarazmq.replay.vocabulary import prompt_vocabulary


def test_an_architecture_name_resolves_only_as_a_dummy() -> None:
    with pytest.raises(ValueError, match="--load-format dummy also an architecture"):
        resolve_model("llama-2-7b")
    source = resolve_model("Llama-2-7B", "dummy")
    assert (source.load_format, source.architecture) == ("dummy", "llama-2-7b")
    config = load_model_config(source)
    arch = ARCHITECTURES["llama-2-7b"]
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (
        arch.num_layers,
        arch.hidden_size,
        arch.num_kv_heads,
        arch.vocab_size,
    )
    assert config.eos_token_ids == ()  # random weights have no end token: runs to max_tokens
    # the tokenizer is the default model's; prompts for the vocabulary come from the arch
    assert len(load_tokenizer(source)) >= 32000
    vocab, avoid = prompt_vocabulary("llama-2-7b", 0, "auto", "dummy")
    assert vocab == 32000 and avoid


def test_a_file_resolves_as_a_dummy_of_its_own_shapes() -> None:
    real = resolve_model("smollm2-135m-instruct")
    dummy = resolve_model("smollm2-135m-instruct", "dummy")
    assert dummy.load_format == "dummy" and not dummy.architecture
    assert load_model_config(dummy) == load_model_config(real)


def test_bad_load_formats_and_architectures_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown load format 'random'"):
        EngineOptions(load_format="random").to_config()
    with pytest.raises(ValueError, match="unknown load format"):
        resolve_model("llama-2-7b", "random")
    with pytest.raises(ValueError, match="plain \\(GELU\\) MLP"):
        resolve_model("falcon-180b", "dummy")
    with pytest.raises(ValueError, match="unknown architecture 'gpt-9'"):
        get_architecture("gpt-9")
    result = CliRunner().invoke(cli_main, ["generate", "--load-format", "random", "hi"])
    assert result.exit_code != 0 and "random" in result.output


def test_a_dummy_engine_generates_every_requested_token() -> None:
    # the default model's shapes (small), random weights: no checkpoint is read
    llm = LLM(model="smollm2-135m", load_format="dummy", num_threads=1, num_kv_blocks=64)
    assert llm.engine.runner.model.config.architecture == "smollm2-135m"
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(["The capital of France is", [5, 6, 7, 8], [49152 + 10]], params)
    assert [len(o.token_ids) for o in outs[:2]] == [6, 6]
    assert all(o.finish_reason == "length" and not o.error for o in outs[:2])
    # a prompt outside the dummy's vocabulary is refused by name, the others unharmed
    assert outs[2].finish_reason == "error" and "[0, 49152)" in outs[2].error


def test_the_api_command_names_the_load_format_an_architecture_needs() -> None:
    args = ["api", "--connect", "tcp://127.0.0.1:1", "--model", "llama-2-7b"]
    result = CliRunner().invoke(cli_main, args)
    assert result.exit_code != 0 and "--load-format dummy" in result.output
