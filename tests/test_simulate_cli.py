"""The simulator against the real engine, and `sarazmq simulate` / `capacity --simulate`
end to end (no model files: GPU latency models, or a profile JSON written here).

The engine comparison runs an in-process `LLMEngine` on a tiny random-weight model, then
the simulator with the engine's measured iteration times: the scheduler must make the
same decisions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from scheduler_harness import sim_config
from test_simulator import Constant

from sarazmq.cli import main
from sarazmq.replay.workload import WorkloadRequest, WorkloadSpec, build_workload
from sarazmq.sim import ReplayLatency, simulate_workload

# ---------------------------------------------------------------------------- vs the engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight 2-layer Llama with a 128-token word-level tokenizer (HF folder)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(out)
    return str(out)


class _PinnedClock:
    """The engine scheduler's clock: real time, except that the next read can be pinned
    (the driver pins each plan's start to the instant it decided arrivals at)."""

    def __init__(self) -> None:
        self.pinned: float | None = None

    def __call__(self) -> float:
        if self.pinned is not None:
            value, self.pinned = self.pinned, None
            return value
        return time.monotonic()


def _run_engine(model: str, reqs: list[WorkloadRequest], engine_kw: dict) -> tuple[float, list]:
    """Runs `reqs` on an in-process LLMEngine, adding each request before the first plan
    built at or after its arrival (arrival instants are iteration boundaries, as in the
    simulator). Returns the start instant and the scheduler's iteration records."""
    from sarazmq.engine import LLMEngine
    from sarazmq.options import EngineOptions
    from sarazmq.sampling_params import SamplingParams

    engine = LLMEngine(EngineOptions(model=model, num_threads=1, **engine_kw).to_config())
    clock = _PinnedClock()
    engine.scheduler.clock = clock
    t0 = time.monotonic()
    now, i = t0, 0
    while i < len(reqs) or engine.has_unfinished():
        while i < len(reqs) and t0 + reqs[i].arrival_s <= now:
            w = reqs[i]
            params = SamplingParams(max_tokens=w.output_tokens, ignore_eos=True, temperature=0)
            engine.add_request(
                w.request_id, "", params, t0 + w.arrival_s, prompt_token_ids=w.prompt_token_ids
            )
            i += 1
        if not engine.has_unfinished():
            now = t0 + reqs[i].arrival_s  # idle: the next arrival starts the next plan
            while time.monotonic() < now:
                time.sleep(now - time.monotonic())
            continue
        clock.pinned = now
        engine.step()
        now = engine.scheduler.iteration_records[-1].end
    return t0, list(engine.scheduler.iteration_records)


@pytest.mark.parametrize(
    ("policy", "arrivals"),
    [("sarathi", "poisson"), ("vllm", "poisson"), ("sarathi", "all_at_once")],
)
def test_same_decisions_as_the_engine(tiny_model: str, policy: str, arrivals: str) -> None:
    """The real engine on a tiny model, then the simulator with the engine's measured
    iteration times: the same batches, iteration by iteration, and the same token times."""
    spec = WorkloadSpec(
        vocab_size=128,
        avoid_ids=(0,),
        lengths="uniform",
        input_range=(4, 60),
        output_range=(2, 16),
        max_requests=14,
        arrivals=arrivals,
        qps=300.0 if arrivals == "poisson" else None,
        seed=1,
    )
    reqs = build_workload(spec)
    engine_kw = {
        "scheduler": policy,
        "chunk_size": 24,
        "max_num_seqs": 5,
        "block_size": 4,
        "num_kv_blocks": 30,  # small: preemptions
        "max_model_len": 256,
        "seed": 0,
    }
    t0, real = _run_engine(tiny_model, reqs, engine_kw)
    # the simulated engine of the same options, through the same door
    config = sim_config(
        num_blocks=30, max_model_len=256, model=tiny_model, **{
            k: v for k, v in engine_kw.items() if k not in ("num_kv_blocks", "max_model_len")
        }
    )  # fmt: skip
    sim = simulate_workload(reqs, config, ReplayLatency([r.end - r.start for r in real]))

    def batches(its: list) -> list[tuple[int, ...]]:
        return [
            (
                it.num_prefill_tokens,
                it.num_decode_tokens,
                it.num_seqs,
                it.num_prefill_seqs,
                it.prefill_attention_pairs,
                it.decode_context_tokens,
                it.num_sampled,
            )
            for it in its
        ]

    assert batches(sim.iterations) == batches(real)
    assert [it.start_s for it in sim.iterations] == pytest.approx(
        [r.start - t0 for r in real], abs=1e-9
    )
    assert sum(r.num_preempted for r in real) == sum(r.num_preemptions for r in sim.records)
    if policy == "sarathi":
        assert sum(r.num_preempted for r in real) > 0  # the pool was tight enough
    if arrivals == "poisson":
        # arrivals were interleaved with iterations (so their timing was under test), and
        # other iteration times give other batches
        assert reqs[-1].arrival_s > real[0].end - t0
        fast = simulate_workload(reqs, config, Constant(1e-4))
        assert batches(fast.iterations) != batches(real)


def test_fitted_model_predicts_an_unseen_workload(tiny_model: str) -> None:
    """Fidelity, loosely: a latency model fitted on one real run's iterations simulates
    another workload (other lengths, all at once: time-bound, not arrival-bound) within
    40 % of the real makespan and mean iteration time. The iterations of this tiny model
    last a few milliseconds on a shared machine, hence the loose bound;
    scripts/sim_fidelity.py checks the full-size model on real traces."""
    from sarazmq.scheduler.latency_fit import fit_latency_model

    engine_kw = {"scheduler": "sarathi", "chunk_size": 48, "max_num_seqs": 16,
                 "block_size": 4, "num_kv_blocks": 600, "max_model_len": 256, "seed": 0}  # fmt: skip

    def workload(seed: int, inputs: tuple[int, int]) -> list[WorkloadRequest]:
        return build_workload(
            WorkloadSpec(
                vocab_size=128, avoid_ids=(0,), lengths="uniform", input_range=inputs,
                output_range=(4, 24), max_requests=40, arrivals="all_at_once", seed=seed,
            )
        )  # fmt: skip

    _, train = _run_engine(tiny_model, workload(3, (8, 120)), engine_kw)
    model = fit_latency_model([r.shape() for r in train], [r.end - r.start for r in train])
    test_reqs = workload(4, (20, 200))
    t0, real = _run_engine(tiny_model, test_reqs, engine_kw)
    config = sim_config(
        num_blocks=600, max_model_len=256, scheduler="sarathi", chunk_size=48, max_num_seqs=16,
        block_size=4, seed=0,
    )  # fmt: skip
    sim = simulate_workload(test_reqs, config, model)
    assert len(sim.iterations) == len(real)  # all at once: the decisions do not depend on time
    real_makespan = real[-1].end - t0
    assert sim.sim_time_s == pytest.approx(real_makespan, rel=0.4)
    real_mean = sum(r.end - r.start for r in real) / len(real)
    sim_mean = sum(it.duration_s for it in sim.iterations) / len(sim.iterations)
    assert sim_mean == pytest.approx(real_mean, rel=0.4)


# ---------------------------------------------------------------------------- the commands


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_cli_gpu_mode_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, text = _cli(
        "simulate", "zipf", "--max-requests", "40", "--qps", "8", "--gpu", "a100",
        "--arch", "mistral-7b", "--chunk-size", "512", "--output-dir", str(out),
        "--no-progress", "--slo-tbt", "0.1",
    )  # fmt: skip
    assert code == 0, text
    assert "latency model: vidur" in text or "latency model: roofline" in text
    assert "TBT" in text and "goodput" in text
    for name in ("summary.json", "requests.csv", "iterations.csv", "records.jsonl"):
        assert (out / name).is_file()
    assert (out / "tbt_cdf.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_completed"] == 40 and summary["num_errors"] == 0
    settings = summary["settings"]
    assert settings["simulated"] is True and settings["sim_wall_s"] > 0
    assert settings["latency_model"]["gpu"] == "a100-80gb"
    assert settings["engine"]["scheduler"]["chunk_size"] == 512
    # the pool came from the GPU's memory: 80 GB x 0.9 less Mistral-7B's bf16 weights
    assert 20_000 < settings["engine"]["cache"]["num_blocks"] < 35_000
    assert summary["workload"]["num_requests"] == 40
    assert summary["goodput"]["slo_tbt_s"] == 0.1


def test_cli_compare_without_plots(tmp_path: Path) -> None:
    code, text = _cli(
        "simulate", "fixed", "--input-tokens", "900", "--output-tokens", "60",
        "--max-requests", "30", "--qps", "6", "--gpu", "a100", "--arch", "mistral-7b",
        "--compare", "sarathi,vllm,orca", "--no-plots", "--output-dir", str(tmp_path),
        "--no-progress",
    )  # fmt: skip
    assert code == 0, text
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert set(data["runs"]) == {"sarathi", "vllm", "orca"} and data["baseline"] == "vllm"
    assert "sarathi/vllm" in text
    assert not list(tmp_path.rglob("*.png"))
    # the policies really differ: vllm's prefills stall decodes, sarathi's do not
    tbt_max = {k: v["tbt_s"]["max"] for k, v in data["runs"].items()}
    assert tbt_max["sarathi"] < tbt_max["vllm"]


def test_cli_profile_mode_hand_computed(tmp_path: Path) -> None:
    """A profile whose model is a constant 10 ms: one request of 3 prompt tokens and 4
    outputs has TTFT 10 ms and TBT 10 ms; the pool comes from the profile's engine."""
    profile = tmp_path / "p.json"
    model = {"kind": "piecewise_linear", "knee": 1, "c0": 0.01, "c_tok": 0.0, "c_pairs": 0.0,
             "c_ctx": 0.0, "c_seq": 0.0, "c_sampled": 0.0}  # fmt: skip
    engine = {"model": "no-such-model", "block_size": 8, "num_kv_blocks": 100}
    profile.write_text(json.dumps({"kind": "piecewise_linear", "model": model, "engine": engine}))
    code, text = _cli(
        "simulate", "fixed", "--input-tokens", "3", "--output-tokens", "4",
        "--max-requests", "1", "--arrivals", "all_at_once", "--profile", str(profile),
        "--output-dir", str(tmp_path / "run"), "--no-plots", "--no-progress",
    )  # fmt: skip
    assert code == 0, text
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["ttft_s"]["p50"] == pytest.approx(0.01)
    assert s["tbt_s"]["count"] == 3 and s["tbt_s"]["max"] == pytest.approx(0.01)
    assert s["iterations"]["count"] == 4
    cache = s["settings"]["engine"]["cache"]
    assert cache["num_blocks"] == 50 and cache["block_size"] == 16  # 800 tokens in blocks of 16
    assert s["settings"]["latency_model"]["source"] == "profile"


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    base = ["simulate", "fixed", "--max-requests", "3", "--qps", "1", "--no-progress"]
    for extra, needle in [
        ([], "--gpu"),
        (["--gpu", "a100"], "--arch"),
        (["--gpu", "a100", "--arch", "no-such"], "unknown architecture"),
        (["--profile", str(tmp_path / "nope.json")], "cannot read"),
        (["--gpu", "a100", "--arch", "mistral-7b", "--connect", "ipc:///x"], "no deployment"),
        (["--gpu", "a100", "--arch", "llama-2-70b"], "does not fit"),
        (
            [
                "--gpu",
                "a100",
                "--arch",
                "mistral-7b",
                "--tbt-slo",
                "0.1",
                "--compare",
                "sarathi,vllm",
            ],
            "--tbt-slo",
        ),  # fmt: skip
    ]:
        code, text = _cli(*base, *extra, "--output-dir", str(tmp_path))
        assert code != 0 and needle in text, (extra, text)
        assert "Traceback" not in text


def test_capacity_simulate(tmp_path: Path) -> None:
    code, text = _cli(
        "capacity", "fixed", "--input-tokens", "1024", "--output-tokens", "128",
        "--max-requests", "120", "--simulate", "--gpu", "a100", "--arch", "mistral-7b",
        "--slo-tbt", "0.05", "--slo-sched-delay", "2", "--lo-qps", "1", "--hi-qps", "4",
        "--max-probes", "4", "--policies", "sarathi,vllm", "--chunk-size", "512",
        "--output-dir", str(tmp_path), "--no-progress",
    )  # fmt: skip
    assert code == 0, text
    data = json.loads((tmp_path / "capacity.json").read_text())
    sarathi, vllm = data["results"]["sarathi"], data["results"]["vllm"]
    assert sarathi["capacity_qps"] is not None and sarathi["capacity_qps"] >= 1
    # vllm's whole-prompt prefills stall decodes past the strict TBT SLO sooner
    assert vllm["capacity_qps"] is None or vllm["capacity_qps"] < sarathi["capacity_qps"]
    probes = list(tmp_path.glob("sarathi/qps-*/summary.json"))
    assert probes and json.loads(probes[0].read_text())["settings"]["simulated"] is True
    code, text = _cli(
        "capacity", "fixed", "--max-requests", "5", "--gpu", "a100", "--arch", "mistral-7b",
        "--slo-tbt", "0.05", "--slo-sched-delay", "2", "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert code != 0 and "need --simulate" in text
