"""Accuracy of the integer-dot GGUF path (`gguf_matmul="int8"`), of the int8 KV cache
(`kv_cache_dtype="int8"`, with either matmul path), of bf16 (`dtype=auto` where the CPU has
native bf16; `--no-bf16` skips it) and of llama.cpp on the same GGUF file, against our
float32 path: teacher-forced next-token distributions over a fixed set of texts
(sarazmq.perf.token_agreement), as top-1 agreement and KL(float32 || path).

    python scripts/accuracy_gguf.py [--chunk 512] [--threads 2] [--texts 12] [--no-bf16]
    # llama.cpp's row: its Python binding importable, e.g. from llama-cpp-python's sdist
    # with the libraries its CMake build made (scripts/peer_clients.sh builds them):
    PYTHONPATH=$SDIST:$DISKCACHE LLAMA_CPP_LIB_PATH=$SDIST/vendor/llama.cpp/build/bin \\
        python scripts/accuracy_gguf.py

Every path sees the same token ids (our tokenizer's), so the rows differ by arithmetic
only. int8 here covers every position (the prompts are prefilled in chunks), as in
serving, where decode steps compute their matmuls by int8 dot products too.
"""

from __future__ import annotations

import argparse
import json

import torch

from sarazmq.config import EngineConfig
from sarazmq.kernels import select_attention_backend
from sarazmq.model.llama import LlamaForCausalLM
from sarazmq.model.loader import load_model, load_model_config, load_tokenizer, resolve_model
from sarazmq.perf.token_agreement import Agreement, pooled, teacher_forced_logits

# Fixed, varied texts (prose, code, lists, dialogue, numbers): what the measure averages over.
TEXTS = [
    "The Industrial Revolution began in Britain in the late eighteenth century, when new "
    "machines for spinning and weaving cotton moved work from homes into factories. Steam "
    "engines, first used to pump water out of mines, soon powered mills, ships and "
    "locomotives, and the growing cities drew workers from the countryside.",
    'def fibonacci(n: int) -> list[int]:\n    """The first n Fibonacci numbers."""\n'
    "    numbers = [0, 1]\n    while len(numbers) < n:\n        numbers.append(numbers[-1] + "
    'numbers[-2])\n    return numbers[:n]\n\n\nif __name__ == "__main__":\n    print('
    "fibonacci(10))\n",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a pan, add a "
    "chopped onion and cook it slowly until soft. Stir in two cloves of garlic, then a tin "
    "of crushed tomatoes, a pinch of salt and a few basil leaves. Let it simmer for twenty "
    "minutes, stirring now and then.",
    "User: What is the difference between weather and climate?\nAssistant: Weather is the "
    "state of the atmosphere at a particular place and time: rain today, sun tomorrow. "
    "Climate is the average of the weather over a long period, usually thirty years or more.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of "
    "plant cells, chlorophyll absorbs light, which drives the splitting of water into "
    "oxygen, protons and electrons. The energy is stored in ATP and NADPH, which the Calvin "
    "cycle then uses to fix carbon dioxide into sugars.",
    "Shopping list for the week: eggs, milk, bread, butter, apples, bananas, spinach, "
    "rice, chicken thighs, chickpeas, yoghurt, coffee, and a bottle of olive oil.",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nJOIN orders "
    "ON orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\nGROUP "
    "BY customers.name\nORDER BY order_count DESC\nLIMIT 10;",
    "Dear Ms. Patel,\n\nThank you for your letter of 12 March. I am pleased to confirm that "
    "your application has been accepted and that your first day will be Monday, 3 April. "
    "Please bring a form of identification and your signed contract.\n\nKind regards,\n"
    "James Carter",
    "The mitochondrion is often called the powerhouse of the cell. It has two membranes, "
    "and the inner one folds into cristae, where the electron transport chain produces most "
    "of the cell's ATP. Mitochondria carry their own small circular genome, inherited from "
    "the mother.",
    "In 1969, Apollo 11 carried Neil Armstrong, Buzz Aldrin and Michael Collins to the "
    "Moon. Armstrong and Aldrin landed in the Sea of Tranquility on July 20 and spent about "
    "two and a half hours outside the lunar module, while Collins orbited above.",
    "Prime numbers below fifty: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47. "
    "Their sum is 328, and there are fifteen of them.",
    "A good night's sleep helps memory, mood and the immune system. Most adults need seven "
    "to nine hours. Keeping a regular schedule, avoiding screens before bed and keeping the "
    "bedroom cool and dark all make it easier to fall asleep.",
]


def llama_cpp_logits(gguf_path: str, texts: list[list[int]], threads: int, batch: int):  # noqa: ANN201
    """llama.cpp's logits [len(ids), vocab] for each text (its own Q4_1/Q8_0 integer dot
    products), or the reason it cannot run."""
    try:
        import llama_cpp  # noqa: PLC0415 (optional peer, not our dependency)
    except ImportError as e:
        return f"llama_cpp not importable ({e})"
    longest = max(len(ids) for ids in texts)
    llm = llama_cpp.Llama(
        gguf_path,
        n_ctx=max(512, longest),
        n_batch=batch,
        n_ubatch=batch,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    out = []
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        out.append(torch.from_numpy(llm.scores[: len(ids)].copy()).float())
    return out


def row(name: str, a: Agreement) -> str:
    return (
        f"| {name} | {a.positions} | {a.top1_agreement:.4f} | {a.mean_kl:.5f} | "
        f"{a.p99_kl:.4f} | {a.max_kl:.3f} | {a.perplexity:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EngineConfig().model)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--texts", type=int, default=len(TEXTS), help=f"the first N of the {len(TEXTS)} texts"
    )
    parser.add_argument(
        "--no-bf16", action="store_true", help="skip the bf16 row (slow without native bf16)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.chunk < 1 or args.threads < 1:
        parser.error(f"--chunk and --threads must be >= 1 (got {args.chunk}, {args.threads})")
    if not 1 <= args.texts <= len(TEXTS):
        parser.error(f"--texts must be 1 to {len(TEXTS)}, got {args.texts}")
    torch.set_num_threads(args.threads)

    try:
        source = resolve_model(args.model)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if source.kind != "gguf":
        parser.error(f"{args.model!r} is not a GGUF model")
    config = load_model_config(source)
    tokenizer = load_tokenizer(source)
    texts = [tokenizer.encode(t) for t in TEXTS[: args.texts]]

    def served(dtype: torch.dtype) -> LlamaForCausalLM:
        # the model as a worker serves it in `dtype` (build_model_runner)
        attention = select_attention_backend("auto", torch.device("cpu"), 16, dtype)
        model = load_model(source, config, dtype, "cpu", attention)
        model.prepack_linear_weights()
        return model

    model = served(torch.float32)

    logits: dict[str, list[torch.Tensor]] = {}
    for mode, kv_cache_dtype in (
        ("float", "auto"),
        ("int8", "auto"),
        ("float", "int8"),
        ("int8", "int8"),
    ):
        if model.set_gguf_matmul(mode) == 0 and mode == "int8":
            if kv_cache_dtype == "auto":  # said once for both of int8's rows
                print("int8: no GGUF matmul takes the integer path on this build; skipped")
            continue
        name = mode if kv_cache_dtype == "auto" else f"{mode}+kv_int8"
        logits[name] = [
            teacher_forced_logits(model, ids, args.chunk, kv_cache_dtype) for ids in texts
        ]
    if not args.no_bf16:
        # bf16, dtype=auto's choice on CPUs with native bf16: the accuracy the int8 path is
        # weighed against there (the float path; its blocks dequantized to bf16)
        del model
        model = served(torch.bfloat16)
        logits["bf16"] = [teacher_forced_logits(model, ids, args.chunk) for ids in texts]
    peer = llama_cpp_logits(source.gguf_path, texts, args.threads, args.chunk)
    if isinstance(peer, str):
        print(f"llama.cpp: skipped, {peer}")
    else:
        logits["llama.cpp"] = peer

    reference = logits["float"]
    print(
        f"\n{len(texts)} texts, {sum(map(len, texts))} positions, prefill chunk {args.chunk}, "
        f"{args.threads} threads; reference: our float32 path on {source.gguf_file}\n"
    )
    print("| path | positions | top-1 agreement | mean KL | P99 KL | max KL | perplexity |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, outs in logits.items():
        a = pooled(list(zip(reference, outs, texts, strict=True)))
        results[name] = a.to_dict()
        label = {
            "float": "sarazmq float32",
            "int8": "sarazmq int8 dot",
            "float+kv_int8": "sarazmq float32, int8 KV cache",
            "int8+kv_int8": "sarazmq int8 dot, int8 KV cache",
            "bf16": "sarazmq bf16 (float path)",
        }.get(name, name)
        print(row(label, a))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
