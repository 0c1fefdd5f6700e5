"""Pipeline parallelism: the layer split, micro-batches in the scheduler, and greedy
outputs identical to one stage, in process and across worker processes (TP x PP)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scheduler_harness import FakeWorker, Requests, drive_inflight, reference_outputs

from sarazmq import LLM
from sarazmq.config import POLICIES, CacheConfig, EngineConfig, SchedulerConfig
from sarazmq.kernels import TorchPagedAttention
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache, stage_layers
from sarazmq.model.loader import load_model, load_model_config, resolve_model
from sarazmq.options import EngineOptions
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler import Scheduler
from sarazmq.scheduler.stats import IterationRecord, active_seconds, bubble_fraction
from sarazmq.worker.pipeline import Placement, driver_rank

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NUM_LAYERS = 5  # an odd count: the stages split it unevenly (3 + 2)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 5-layer Llama whose heads split over 3 ranks (6 heads, 3 KV heads), with
    a 128-token word-level tokenizer (a Hugging Face folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_pp") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: clear greedy winners
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(out)
    return str(out)


def _prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---------------------------------------------------------------------------- split, config


def test_stage_layers_split_evenly_earlier_stages_take_the_remainder() -> None:
    assert [list(stage_layers(10, 4, s)) for s in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
        [8, 9],
    ]
    assert [len(stage_layers(30, 2, s)) for s in range(2)] == [15, 15]
    assert list(stage_layers(3, 3, 2)) == [2]
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=4 exceeds the model's num_layers=3"
    ):
        stage_layers(3, 4, 0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be >= 1"):
        stage_layers(3, 0, 0)
    with pytest.raises(ValueError, match="pp_rank=2"):
        stage_layers(4, 2, 2)


def test_invalid_pipeline_configs_are_refused(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be >= 1"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=-1"):
        EngineOptions(pipeline_parallel_size=-1).to_config()
    assert EngineOptions(pipeline_parallel_size=3).to_config().pipeline_parallel_size == 3
    with pytest.raises(ValueError, match="tbt_slo=0.05 needs pipeline_parallel_size=1"):
        EngineOptions(pipeline_parallel_size=2, tbt_slo=0.05).to_config()
    with pytest.raises(ValueError, match="exceeds the model's num_layers=5"):
        LLM(model=tiny_model, pipeline_parallel_size=6)
    with pytest.raises(ValueError, match="max_inflight=0 must be >= 1"):
        Scheduler(SchedulerConfig(), 4, 16, 64, (), max_inflight=0)


def test_cli_pp_option_builds_the_config() -> None:
    import click
    from click.testing import CliRunner

    from sarazmq.cli.options import engine_config, engine_options

    seen: dict[str, EngineConfig] = {}

    @engine_options
    def cmd(**kw: object) -> None:
        seen["cfg"] = engine_config(kw)

    command = click.command()(cmd)
    result = CliRunner().invoke(command, ["--pp", "2", "--tp", "3"])
    assert result.exit_code == 0, result.output
    assert seen["cfg"].pipeline_parallel_size == 2 and seen["cfg"].tensor_parallel_size == 3
    bad = CliRunner().invoke(command, ["--pp", "0"])
    assert bad.exit_code != 0 and "pipeline_parallel_size=0 must be >= 1" in bad.output


def test_placement_ranks() -> None:
    # global rank = stage * tp + tp_rank; the driver is tp rank 0 of the last stage
    p = Placement(rank=4, tp_size=3, pp_size=2)
    assert (p.pp_rank, p.tp_rank, p.prev_rank, p.next_rank) == (1, 1, 1, None)
    assert Placement(1, 3, 2).next_rank == 4 and Placement(1, 3, 2).prev_rank is None
    assert [r for r in range(6) if Placement(r, 3, 2).is_driver] == [3] == [driver_rank(3, 2)]
    assert Placement(0, 1, 1).is_driver
    assert Placement(0, 3, 2).stage_ranks(1) == [3, 4, 5]
    with pytest.raises(ValueError, match=r"rank=6 must be in \[0, 6\)"):
        Placement(6, 3, 2)


def test_stages_hold_their_layers_and_chain_to_the_whole_model(tiny_model: str) -> None:
    source = resolve_model(tiny_model)
    cfg = load_model_config(source)
    attn = TorchPagedAttention()
    whole = load_model(source, cfg, torch.float32, "cpu", attn)
    stages = [
        load_model(source, cfg, torch.float32, "cpu", attn, pp_rank=s, pp_size=2) for s in (0, 1)
    ]
    assert [list(m.layer_range) for m in stages] == [[0, 1, 2], [3, 4]]
    assert stages[0].norm is None and stages[0].lm_head is None
    assert stages[1].embed_tokens is not None  # tied head: the last stage keeps the table
    assert stages[1].norm is not None and stages[1].lm_head is not None
    torch.testing.assert_close(stages[1].layers[0].input_layernorm, whole.layers[3].input_layernorm)
    with pytest.raises(ValueError, match="has no LM head"):
        stages[0].compute_logits(torch.zeros(1, cfg.hidden_size))

    ids = _prompts(1)[0]
    blocks, bs = 16, 4
    table = list(range(blocks - 1, -1, -1))[: -(-len(ids) // bs)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], bs)
    pos = torch.arange(len(ids))
    ref = whole.compute_logits(
        whole(
            torch.tensor(ids), pos, allocate_kv_cache(cfg, blocks, bs, torch.float32, "cpu"), meta
        )
    )
    caches = [
        allocate_kv_cache(cfg, blocks, bs, torch.float32, "cpu", num_layers=n) for n in (3, 2)
    ]
    acts = stages[0](torch.tensor(ids), pos, caches[0], meta)
    assert acts.shape == (2, len(ids), cfg.hidden_size)
    with pytest.raises(ValueError, match="needs the previous stage's activations"):
        stages[1](torch.tensor(ids), pos, caches[1], meta)
    out = stages[1].compute_logits(stages[1](torch.tensor(ids), pos, caches[1], meta, acts))
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------- micro-batches


def _drive_pipelined(
    sched: Scheduler, requests: Requests, abort_at: int = -1
) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """`drive_inflight`, checking that a request is in at most one plan in flight.
    Returns outputs, finish reasons and the most plans in flight at once."""
    most = 0

    def on_plan(sched: Scheduler, seqs: set[int], earlier: list[set[int]]) -> None:
        nonlocal most
        for other in earlier:
            assert not seqs & other, "a request in two plans in flight"
        most = max(most, len(earlier) + 1)

    outputs, finish = drive_inflight(sched, requests, abort_at=abort_at, on_plan=on_plan)
    return outputs, finish, most


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pp", [2, 3])
def test_micro_batches_give_each_request_its_own_outputs(policy: str, pp: int) -> None:
    """Up to pp plans in flight, a request in at most one, results in order: every
    request's outputs are what it would output alone, under every policy, with
    preemptions (a small pool) and the prefix cache on."""
    rng = random.Random(7)
    shared = [rng.randrange(1, 100) for _ in range(8)]
    requests = [
        (
            f"r{i}",
            (shared if i % 2 else [])
            + [rng.randrange(1, 100) for _ in range(rng.randrange(2, 30))],
            SamplingParams(temperature=0, max_tokens=rng.randrange(2, 12), ignore_eos=True),
        )
        for i in range(12)
    ]
    cfg = SchedulerConfig(policy=policy, chunk_size=16, max_num_seqs=6)
    sched = Scheduler(cfg, 4, 40, 128, (), enable_prefix_caching=True, max_inflight=pp)
    outputs, finish, most = _drive_pipelined(sched, requests)
    assert most >= 2  # micro-batches really overlapped
    for seq_id, (rid, prompt, params) in enumerate(requests):
        expect, _ = reference_outputs(seq_id, prompt, params, params.max_tokens, ())
        assert outputs[rid] == expect and finish[rid] == "length", rid
    stats = sched.stats()
    assert stats.pipeline_parallel_size == pp and len(stats.stage_busy_s) == pp


def test_running_requests_split_evenly_over_micro_batches() -> None:
    sched = Scheduler(SchedulerConfig(chunk_size=64, max_num_seqs=8), 4, 64, 64, (), max_inflight=2)
    for i in range(8):
        sched.add_request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    worker = FakeWorker(4, 64)
    first = sched.schedule()
    assert first is not None and len(first.scheduled) == 8  # all admitted together
    assert sched.schedule() is None  # every request is in flight
    sched.process_result(worker.run(first))
    a, b = sched.schedule(), sched.schedule()
    assert a is not None and b is not None
    assert [len(p.scheduled) for p in (a, b)] == [4, 4]
    assert not {s.seq_id for s in a.scheduled} & {s.seq_id for s in b.scheduled}
    ra, rb = worker.run(a), worker.run(b)
    with pytest.raises(
        ValueError, match=f"result is for step {b.step}, plan in flight is {a.step}"
    ):
        sched.process_result(rb)  # results in FIFO order only; nothing applied
    sched.process_result(ra)
    sched.process_result(rb)
    assert sched.num_inflight == 0


def test_policy_view_merges_back_in_admission_order() -> None:
    from types import SimpleNamespace

    from sarazmq.scheduler.inflight import PolicyView

    a, b, c, d, e = (SimpleNamespace(seq_id=i) for i in range(5))
    running = [a, b, c, d]
    view = PolicyView(running, inflight_seq_ids={0}, share=2)  # type: ignore[arg-type]
    assert view.running == [b, c] and view.num_hidden == 2
    view.running.remove(b)  # preempted ...
    view.running.extend([e, b])  # ... then a new request and b admitted again
    view.merge()
    assert running == [a, c, d, e, b]


def test_abort_while_several_plans_are_in_flight() -> None:
    requests = [
        (f"r{i}", [i + 1] * (5 + i), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for i in range(6)
    ]
    sched = Scheduler(SchedulerConfig(chunk_size=8, max_num_seqs=6), 4, 40, 128, (), max_inflight=2)
    outputs, finish, _ = _drive_pipelined(sched, requests, abort_at=4)
    assert finish["r0"] == "abort"
    assert all(finish[f"r{i}"] == "length" for i in range(1, 6))


def test_bubble_fraction_of_records() -> None:
    def rec(start: float, end: float, busy: list[float]) -> IterationRecord:
        return IterationRecord(0, start, end, 1, 0, 1, 1, 0, stage_busy_s=busy)

    # two stages busy the whole active time of 2 s: no bubble
    full = [rec(0.0, 1.5, [1.0, 0.5]), rec(0.5, 2.0, [1.0, 1.5])]
    assert active_seconds((r.start, r.end) for r in full) == 2.0
    assert bubble_fraction(full, 2) == 0.0
    # one stage busy half the time, the other idle: 3/4 idle; a gap is not active time
    half = [rec(0.0, 1.0, [0.5, 0.0]), rec(5.0, 6.0, [0.5, 0.0])]
    assert bubble_fraction(half, 2) == pytest.approx(0.75)
    assert bubble_fraction([], 2) == 0.0
    with pytest.raises(ValueError, match="num_stages=0"):
        bubble_fraction(full, 0)


# ---------------------------------------------------------------------------- real model


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", _text(p), GREEDY)  # as a deployment gets them
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def _small(policy: str = "sarathi") -> dict[str, object]:
    # float32: micro-batches are composed differently from PP=1's batches, and bf16
    # roundings follow a batch's composition
    return dict(
        scheduler=policy,
        chunk_size=32,
        max_num_seqs=8,
        num_kv_blocks=64,
        block_size=4,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[str, list[list[int]]]:
    """Greedy outputs of one stage, per policy (a small pool: preemptions happen)."""
    return {p: _generate(LLM(model=tiny_model, **_small(p)), _prompts()) for p in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_in_process_pp2_equals_pp1(tiny_model: str, reference, policy: str) -> None:
    llm = LLM(model=tiny_model, pipeline_parallel_size=2, **_small(policy))
    assert _generate(llm, _prompts()) == reference[policy]
    stats = llm.engine.scheduler.stats()
    assert stats.num_iterations > 0 and 0.0 <= stats.bubble_fraction < 1.0
    assert all(b > 0 for b in stats.stage_busy_s)
    records = list(llm.engine.scheduler.iteration_records)
    assert all(len(r.stage_busy_s) == 2 for r in records if r.num_seqs)


def _deployment_config(model: str, tp: int, pp: int, policy: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_threads=1,
        dtype="float32",
        scheduler=SchedulerConfig(policy=policy, chunk_size=32, max_num_seqs=8),
        cache=CacheConfig(block_size=4, num_blocks=64),
    )


@pytest.mark.parametrize(("tp", "pp", "policy"), [(1, 2, "sarathi"), (3, 2, "vllm")])
def test_deployment_tp_pp_equals_pp1(
    tiny_model: str, reference, tp: int, pp: int, policy: str
) -> None:
    """Worker processes: stages exchange activations over torch.distributed (gloo), tp
    ranks all-reduce inside their stage; the outputs are one stage's."""
    from sarazmq.client import Client
    from sarazmq.procs.launcher import Deployment

    prompts = _prompts()
    with (
        Deployment(_deployment_config(tiny_model, tp, pp, policy)) as dep,
        Client(dep.endpoint) as c,
    ):
        assert len([n for n in dep.pids if n.startswith("worker")]) == tp * pp
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: c.generate(_text(p), GREEDY).token_ids, prompts))
        stats = c.stats()
    assert outs == reference[policy]
    assert stats["pipeline_parallel_size"] == pp and len(stats["stage_busy_s"]) == pp
    assert all(b > 0 for b in stats["stage_busy_s"]) and 0.0 <= stats["bubble_fraction"] < 1.0


def test_engine_refuses_tensor_parallel_in_process(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the in-process engine runs tp=1"):
        LLM(model=tiny_model, tensor_parallel_size=2, pipeline_parallel_size=2)


def test_kv_cache_is_allocated_for_the_stage_layers_only(tiny_model: str) -> None:
    llm = LLM(model=tiny_model, pipeline_parallel_size=2, **_small())
    runners = llm.engine.runner.runners  # type: ignore[union-attr]
    assert [len(r.kv_caches) for r in runners] == [3, 2]
    assert runners[0].sampler is None and runners[1].sampler is not None


def test_replay_reports_the_pipeline_of_a_multi_stage_deployment() -> None:
    from sarazmq.cli.runs import pipeline_line, pipeline_summary

    one = {"server_stats_at_end": {"pipeline_parallel_size": 1, "bubble_fraction": 0.0}}
    assert pipeline_summary(one) is None
    assert pipeline_summary({}) is None
    end = {
        "pipeline_parallel_size": 2,
        "bubble_fraction": 0.25,
        "active_s": 10.0,
        "stage_busy_s": [7.0, 8.0],
        "num_running": 0,
    }
    summary = pipeline_summary({"server_stats_at_end": end})
    assert summary == {
        "pipeline_parallel_size": 2,
        "bubble_fraction": 0.25,
        "active_s": 10.0,
        "stage_busy_s": [7.0, 8.0],
    }
    line = pipeline_line(summary)
    assert "2 stages" in line and "bubble fraction 0.250" in line and "0.70, 0.80" in line
