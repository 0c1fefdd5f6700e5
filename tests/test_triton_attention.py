"""Triton attention kernels against the torch backend, under Triton's CPU interpreter; and
which backend `auto` picks for each device.

TRITON_INTERPRET=1 must be set before the kernels module is first imported (each
@triton.jit decides then whether it compiles or interprets). It is put back afterwards so
that other test modules see this machine as it is; the tests here set it again.
"""

from __future__ import annotations

import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sarazmq.kernels import (  # noqa: E402
    TorchPagedAttention,
    TritonPagedAttention,
    choose_attention_backend,
    select_attention_backend_with_reason,
)
from sarazmq.kernels import triton_attention as ta  # noqa: E402
from sarazmq.kernels.metadata import AttentionMetadata  # noqa: E402
from sarazmq.kernels.torch_attention import write_kv_cache  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

if not ta.INTERPRETED:  # imported earlier in this process without the interpreter
    pytest.skip("the Triton kernels were built for a GPU in this process", allow_module_level=True)

pytestmark = pytest.mark.one_torch_thread


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _batch(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[Batch, AttentionMetadata]:
    """Random hybrid batch, seqs = [(q_len, k_len)] with decodes first: (q, k, v, k_cache,
    v_cache) and its metadata. Each sequence's blocks are scattered (shuffled block ids)
    over a cache of large garbage; its earlier k_len - q_len keys are already there."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    per_seq = [(k + block_size - 1) // block_size for _, k in seqs]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in per_seq:
        tables.append(perm[:n])
        perm = perm[n:]
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = (torch.randn(shape, generator=g) * 100).to(dtype)
    v_cache = (torch.randn(shape, generator=g) * 100).to(dtype)
    # the earlier context, written as if it were one step's new tokens
    ctx_lens = [k - q for q, k in seqs]
    ctx = AttentionMetadata.build(ctx_lens, ctx_lens, tables, block_size)
    if ctx.num_tokens:
        ck = torch.randn(ctx.num_tokens, hkv, head_dim, generator=g).to(dtype)
        write_kv_cache(ck, ck.flip(0), k_cache, v_cache, ctx.slot_mapping)
    meta = AttentionMetadata.build([q for q, _ in seqs], [k for _, k in seqs], tables, block_size)
    t = meta.num_tokens
    q = torch.randn(t, h, head_dim, generator=g).to(dtype)
    k = torch.randn(t, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(t, hkv, head_dim, generator=g).to(dtype)
    return (q, k, v, k_cache, v_cache), meta


def _check(
    batch: Batch,
    meta: AttentionMetadata,
    atol: float,
    rtol: float,
    **tiles: int,
) -> None:
    """Triton forward (kernels write the caches, then attend) against the torch backend
    on copies of the same caches: same output within tolerance, bitwise-same caches."""
    q, k, v, k_cache, v_cache = batch
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, 0.3)
    ta.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.3, **tiles)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# decodes (one with a single key), a fresh prompt, chunks over context; odd lengths, last
# blocks partly filled at every block size
MIXED = [(1, 1), (1, 7), (1, 33), (5, 5), (9, 29), (3, 50)]


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)])
def test_fp32_hybrid_batch_matches_torch(block_size: int, heads: tuple[int, int]) -> None:
    batch, meta = _batch(MIXED, heads, 12, block_size, torch.float32, seed=block_size)
    _check(batch, meta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "seqs",
    [[(1, 3), (1, 17), (1, 64), (1, 90)], [(37, 37), (13, 71)]],
    ids=["decodes", "prefills"],
)
def test_fp32_decodes_only_and_prefills_only(seqs: list[tuple[int, int]]) -> None:
    batch, meta = _batch(seqs, (6, 2), 20, 16, torch.float32, seed=1)
    _check(batch, meta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 32])
def test_several_query_and_key_tiles(block_size: int) -> None:
    # 16-key and 16-row tiles: the online softmax crosses tiles and blocks, the causal
    # limit falls inside a tile, a chunk needs several query tiles (5 tokens of 3 heads)
    seqs = [(1, 90), (1, 18), (23, 23), (17, 83)]
    batch, meta = _batch(seqs, (9, 3), 16, block_size, torch.float32, seed=2)
    _check(batch, meta, atol=1e-5, rtol=1e-5, block_m=16, block_n=16)


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)], ids=["bf16", "fp16"]
)
def test_half_precision_close_to_torch(dtype: torch.dtype, atol: float) -> None:
    batch, meta = _batch(MIXED, (8, 2), 12, 16, dtype, seed=3)
    _check(batch, meta, atol=atol, rtol=2e-2)


def test_backend_forward_and_empty_batch() -> None:
    batch, meta = _batch(MIXED, (6, 2), 8, 4, torch.float32, seed=4)
    q, k, v, k_cache, v_cache = batch
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    backend = TritonPagedAttention(4)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3)
    ref = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert backend.fused_decode_step([], q, [], None) is None  # type: ignore[arg-type]
    assert backend.hybrid_step() is None
    empty = AttentionMetadata.build([], [], [], 4)
    none = q[:0]
    assert backend.forward(none, k[:0], v[:0], k_cache, v_cache, empty, 0.3).shape == (0, 6, 8)
    with pytest.raises(ValueError, match="block size 4 != backend block_size 8"):
        TritonPagedAttention(8).forward(q, k, v, k_cache, v_cache, meta, 0.3)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_kv_write_matches_torch_and_converts_dtype(block_size: int) -> None:
    g = torch.Generator().manual_seed(block_size)
    cache = torch.randn(5, block_size, 3, 12, generator=g).to(torch.bfloat16)
    k, v = torch.randn(2, 7, 3, 12, generator=g)  # float32 rows into a bf16 cache
    slots = torch.randperm(5 * block_size, generator=g)[:7]
    if block_size == 1:
        slots = torch.randperm(5, generator=g)
        k, v = k[:5], v[:5]
    ref_k, ref_v = cache.clone(), cache.clone()
    write_kv_cache(k, v, ref_k, ref_v, slots)
    k_cache, v_cache = cache.clone(), cache.clone()
    ta.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_kv_write_skips_padding_slots() -> None:
    k_cache = torch.zeros(2, 4, 2, 8)
    v_cache = torch.zeros(2, 4, 2, 8)
    k = torch.ones(3, 2, 8)
    ta.write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.sum() == 2 * 16 and v_cache.sum() == -2 * 16
    assert k_cache[1, 1].eq(1).all() and k_cache[0, 0].eq(1).all()


def test_unsupported_inputs_raise_clear_errors() -> None:
    batch, meta = _batch([(1, 5), (3, 3)], (4, 2), 8, 4, torch.float32, seed=5)
    q, k, v, k_cache, v_cache = batch
    with pytest.raises(ValueError, match="power-of-two block_size"):
        TritonPagedAttention(12)
    with pytest.raises(ValueError, match="no int8"):
        ta.write_kv_cache(k, v, k_cache.to(torch.int8), v_cache.to(torch.int8), meta.slot_mapping)
    with pytest.raises(ValueError, match="q dtype"):
        ta.paged_attention(q.double(), k_cache, v_cache, meta, 0.3)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        big = torch.zeros(1, 4, 1, 264)
        ta.paged_attention(torch.zeros(4, 2, 264), big, big, meta, 0.3)
    with pytest.raises(ValueError, match="block_n=24"):
        ta.paged_attention(q, k_cache, v_cache, meta, 0.3, block_n=24)


# ---------------------------------------------------------------------------- selection

_FIT = {"kv_cache_dtype": "auto", "block_size": 16, "dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("device", "flash", "triton", "cpu", "overrides", "name", "why"),
    [
        ("cuda", True, True, False, {"block_size": 256}, "flash_attn", "flash-attn imports"),
        ("cuda", True, True, False, {}, "triton", "not a multiple of 256"),
        ("cuda", False, True, False, {"block_size": 256}, "triton", "does not import"),
        (
            "cuda",
            True,
            True,
            False,
            {"dtype": torch.float32, "block_size": 256},
            "triton",
            "float16",
        ),
        ("cuda", False, False, False, {}, "torch", "not triton: triton does not import"),
        ("cuda", False, True, False, {"kv_cache_dtype": "int8"}, "torch", "not int8"),
        ("cuda", False, True, False, {"block_size": 24}, "torch", "not a power of two"),
        ("cpu", True, True, True, {}, "cpu", "native kernel built"),
        ("cpu", False, True, False, {}, "torch", "native kernel not built"),
        ("mps", False, False, False, {}, "torch", "mps device"),
    ],
)
def test_auto_choice_per_device(
    device: str,
    flash: bool,
    triton: bool,
    cpu: bool,
    overrides: dict[str, object],
    name: str,
    why: str,
) -> None:
    kwargs = {**_FIT, **overrides}
    chosen, reason = choose_attention_backend(
        "auto", device, flash_attn_ok=flash, triton_ok=triton, cpu_ok=cpu, **kwargs
    )
    assert chosen == name
    assert reason.startswith(f"attention {name} (auto: ") and why in reason
    assert "\n" not in reason


def test_explicit_triton_request_names_the_problem() -> None:
    flags = {"flash_attn_ok": False, "cpu_ok": True, **_FIT}
    name, reason = choose_attention_backend("triton", "cuda", triton_ok=True, **flags)
    assert (name, reason) == ("triton", "attention triton (requested)")
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu.*TRITON_INTERPRET=1"):
        choose_attention_backend("triton", "cpu", triton_ok=False, **flags)
    with pytest.raises(ValueError, match="triton package could not be imported"):
        choose_attention_backend("triton", "cuda", triton_ok=False, **flags)
    with pytest.raises(ValueError, match="not int8"):
        choose_attention_backend(
            "triton", "cuda", triton_ok=True, **{**flags, "kv_cache_dtype": "int8"}
        )
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        choose_attention_backend("fast", "cuda", triton_ok=True, **flags)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    backend, reason = select_attention_backend_with_reason("triton", cpu, 16, torch.float32)
    assert isinstance(backend, TritonPagedAttention) and reason == "attention triton (requested)"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        select_attention_backend_with_reason("triton", cpu, 16, torch.float32)
    backend, reason = select_attention_backend_with_reason("auto", cpu, 16, torch.float32)
    assert backend.name in ("cpu", "torch") and reason.startswith(f"attention {backend.name}")


def test_startup_prints_the_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sarazmq.config import EngineConfig
    from sarazmq.worker import build

    class _Stop(Exception):
        pass

    def stop(*args: object, **kwargs: object) -> None:
        raise _Stop

    # the log line comes before the model loads: stop there
    monkeypatch.setattr(build, "resolve_model", lambda model, load_format="auto": model)
    monkeypatch.setattr(build, "load_model", stop)
    config = EngineConfig(device="cpu", dtype="float32", attention_backend="triton")
    with caplog.at_level(logging.INFO, logger=build.__name__), pytest.raises(_Stop):
        build.build_model_runner(config, None)  # type: ignore[arg-type]
    assert "worker 0: attention triton (requested)" in caplog.messages


def test_tiny_model_steps_match_the_torch_backend() -> None:
    # a random 2-layer Llama through a prompt step and a hybrid step (two decodes and a
    # later chunk of a third prompt), each backend on its own caches
    from sarazmq.config import ModelConfig
    from sarazmq.model.kv_cache import allocate_kv_cache
    from sarazmq.model.llama import LlamaForCausalLM

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
        num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position=64, tie_word_embeddings=True,
    )  # fmt: skip
    tables = [[3, 0], [5, 1, 7], [2, 6, 4]]
    steps = [([7, 5, 4], [7, 5, 4]), ([1, 1, 6], [8, 6, 10])]  # (q_lens, k_lens)
    logits = []
    for backend in (TorchPagedAttention(), TritonPagedAttention(4)):
        model = LlamaForCausalLM(cfg, backend)
        model.random_init_(seed=7)
        caches = allocate_kv_cache(cfg, 8, 4, torch.float32, "cpu")
        ids = torch.Generator().manual_seed(1)
        for q_lens, k_lens in steps:
            meta = AttentionMetadata.build(q_lens, k_lens, tables, 4)
            tokens = torch.randint(0, 64, (sum(q_lens),), generator=ids)
            assert meta.positions is not None
            logits.append(model.compute_logits(model(tokens, meta.positions, caches, meta)))
    for ref, out in zip(logits[:2], logits[2:], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_the_device_checks_kernel_part_runs_on_the_cpu() -> None:
    """scripts/gpu_check.py's kernel part (what a lent GPU runs first) on this CPU, under
    the interpreter, so the script cannot rot while no device is lent."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows = gpu_check.part_kernels(torch.device("cpu"), quick=True)
    blank = rows.index("")
    results = [row.rsplit("|", 2)[-2].strip() for row in rows[2:blank]]
    assert len(results) == 3 and set(results) == {"True"}, rows
    # then the Triton elementwise ops against torch's: float32 here, last-bit differences
    ops = {row.split("|")[1].strip(): float(row.split("|")[2]) for row in rows[blank + 3 :]}
    assert set(ops) == {"rms_norm + residual", "rope (q and k heads)", "silu_mul"}, rows
    assert max(ops.values()) < 1e-5 and ops["rope (q and k heads)"] == 0.0, rows
