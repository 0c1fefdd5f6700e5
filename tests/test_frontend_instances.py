"""The frontend over several engine instances, without sockets: routing, load reports,
an instance's death (re-route what has not streamed, fail the rest, drop late outputs),
its return, and stats asked of every instance."""

from __future__ import annotations

import msgspec
from test_frontend import CharTokenizer

from sarazmq.frontend.prompts import PromptTokenizer
from sarazmq.frontend.service import FrontendService
from sarazmq.protocol.client import (
    AbortRequest,
    GenerateRequest,
    OutputDelta,
    ResetPrefixCacheRequest,
    StatsReply,
    StatsRequest,
)
from sarazmq.protocol.engine import (
    Abort,
    AddRequest,
    InstanceDown,
    InstanceLoad,
    InstanceUp,
    OutputBatch,
    StatsAnswer,
    StatsQuery,
)
from sarazmq.router import InstanceTable, Router, RouterConfig

enc = msgspec.msgpack.Encoder()


def _frontend(n: int = 2, policy: str = "round-robin") -> FrontendService:
    router = Router(RouterConfig(policy=policy), InstanceTable([64] * n, [100] * n), 4)
    return FrontendService(
        PromptTokenizer(CharTokenizer(), vocab_size=100, max_model_len=64), router=router
    )


def _send(fe: FrontendService, rid: str, prompt: str = "hello") -> tuple[int, AddRequest]:
    acts = fe.on_client_frame(b"c", enc.encode(GenerateRequest(rid, prompt=prompt)))
    ((instance, add),) = zip(acts.to_instance, acts.to_scheduler)
    assert isinstance(add, AddRequest)
    return instance, add


def test_requests_are_spread_and_aborts_follow_them() -> None:
    fe = _frontend(3)
    sent = [_send(fe, f"r{i}") for i in range(6)]
    assert [i for i, _ in sent] == [0, 1, 2, 0, 1, 2]
    acts = fe.on_client_frame(b"c", enc.encode(AbortRequest("r4")))
    assert acts.to_instance == [1] and acts.to_scheduler == [Abort(sent[4][1].request_id)]


def test_least_load_uses_reports_and_what_was_sent_since() -> None:
    fe = _frontend(2, "least-load")
    # instance 0 reports a long queue: new requests go to 1 until 1 has as much
    fe.on_engine_message(InstanceLoad(0, 0, 3, 0, 200, 0, 100))
    placed = [_send(fe, f"r{i}", "x" * 40)[0] for i in range(4)]
    assert placed[:4] == [1, 1, 1, 1]
    assert fe.router.table[1].queued_tokens == 160


def test_a_dead_instance_moves_what_has_not_streamed_and_fails_the_rest() -> None:
    fe = _frontend(2)
    (i0, a0), (i1, a1), (i2, a2), (i3, a3) = (_send(fe, f"r{i}") for i in range(4))
    assert (i0, i1, i2, i3) == (0, 1, 0, 1)
    # r1 streamed a token on instance 1, r3 did not
    out = fe.on_engine_message(OutputBatch([OutputDelta(request_id=a1.request_id, text="a")]))
    assert out.to_clients[0][1].request_id == "r1"
    acts = fe.on_engine_message(InstanceDown(1, "replica1-worker-0 exited"))
    # r3 moved to instance 0 under a new engine id; r1 failed with the reason
    ((where, moved),) = zip(acts.to_instance, acts.to_scheduler)
    assert where == 0 and isinstance(moved, AddRequest)
    assert moved.request_id != a3.request_id and moved.prompt_token_ids == a3.prompt_token_ids
    ((ident, failed),) = acts.to_clients
    assert ident == b"c" and failed.request_id == "r1" and failed.finish_reason == "error"
    assert "replica1-worker-0 exited" in failed.error and failed.error_type == "engine"
    # late outputs of the dead instance for its old ids reach nobody
    late = OutputBatch(
        [
            OutputDelta(request_id=a3.request_id, text="old", finish_reason="length"),
            OutputDelta(request_id=a1.request_id, text="old", finish_reason="length"),
        ]
    )
    assert fe.on_engine_message(late).to_clients == []
    # the moved request streams and finishes under the client's id, once
    done = fe.on_engine_message(
        OutputBatch([OutputDelta(request_id=moved.request_id, text="b", finish_reason="length")])
    )
    ((_, final),) = done.to_clients
    assert final.request_id == "r3" and final.finish_reason == "length"
    assert fe.counters()["num_rerouted"] == 1
    # an abort of a moved request goes to its new instance and id
    (_, a4) = _send(fe, "r4")
    assert fe.on_client_frame(b"c", enc.encode(AbortRequest("r4"))).to_scheduler == [
        Abort(a4.request_id)
    ]
    # while instance 1 is down every new request goes to 0; back up, it takes turns again
    assert [_send(fe, f"s{i}")[0] for i in range(3)] == [0, 0, 0]
    fe.on_engine_message(InstanceUp(1))
    assert sorted(_send(fe, f"u{i}")[0] for i in range(2)) == [0, 1]


def test_no_instance_left_fails_new_requests() -> None:
    fe = _frontend(2)
    _, add = _send(fe, "r0")
    fe.on_engine_message(InstanceDown(0, "gone"))
    fe.on_engine_message(InstanceDown(1, "gone too"))
    acts = fe.on_client_frame(b"c", enc.encode(GenerateRequest("r1", prompt="x")))
    ((_, reply),) = acts.to_clients
    assert reply.finish_reason == "error" and "engine is down" in reply.error
    assert acts.to_scheduler == []
    stats = fe.on_client_frame(b"c", enc.encode(StatsRequest("q"))).to_clients
    assert "dead" in stats[0][1].stats


def test_stats_are_asked_of_every_live_instance_and_merged() -> None:
    fe = _frontend(3)
    fe.on_engine_message(InstanceDown(2, "gone"))
    acts = fe.on_client_frame(b"c", enc.encode(StatsRequest("q", iterations_from=5)))
    assert acts.to_instance == [0, 1]
    parts = acts.to_scheduler
    assert all(isinstance(p, StatsQuery) and p.iterations_from == 5 for p in parts)
    first = fe.on_engine_message(
        StatsAnswer(
            parts[0].request_id,
            {"num_running": 2, "num_total_blocks": 100, "iterations": [{"step": 5}]},
        )
    )
    assert first.to_clients == []  # instance 1 has not answered yet
    ((_, reply),) = fe.on_engine_message(
        StatsAnswer(parts[1].request_id, {"num_running": 1, "num_total_blocks": 100})
    ).to_clients
    assert isinstance(reply, StatsReply) and reply.request_id == "q"
    s = reply.stats
    assert s["num_running"] == 3 and s["num_total_blocks"] == 200
    assert s["iterations"] == [{"step": 5, "instance": 0}]
    assert [(r["instance"], r["alive"]) for r in s["replicas"]] == [
        (0, True),
        (1, True),
        (2, False),
    ]
    assert s["frontend"]["router"]["policy"] == "round-robin"


def test_a_question_waiting_on_an_instance_that_dies_is_answered_without_it() -> None:
    fe = _frontend(2)
    parts = fe.on_client_frame(b"c", enc.encode(ResetPrefixCacheRequest("z"))).to_scheduler
    fe.on_engine_message(StatsAnswer(parts[0].request_id, {"reset": True, "error": ""}))
    ((_, reply),) = fe.on_engine_message(InstanceDown(1, "gone")).to_clients
    assert reply.request_id == "z" and reply.stats["reset"] is False
    assert "gone" in reply.stats["error"]
