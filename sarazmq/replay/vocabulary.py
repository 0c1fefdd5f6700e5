"""Which token ids a replay's random prompts are drawn from."""

from __future__ import annotations


def parse_id_ranges(text: str) -> tuple[int, ...]:
    """'0-16,100' -> (0, 1, ..., 16, 100). Raises ValueError naming the bad part."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"--avoid-ids: {part!r} is not an id or a range LO-HI") from None
        if a < 0 or b < a:
            raise ValueError(f"--avoid-ids: {part!r} must be ids >= 0 with LO <= HI")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def prompt_vocabulary(
    model: str, vocab_size: int, avoid: str, load_format: str = "auto"
) -> tuple[int, tuple[int, ...]]:
    """(vocab_size, avoid_ids) for the prompts: the given values, or read from the model
    (its config for the vocabulary, its tokenizer's special tokens for 'auto');
    load_format as the engine's (`--load-format dummy` resolves architecture names)."""
    if vocab_size < 0:
        raise ValueError(f"--vocab-size={vocab_size} must be >= 0")
    from sarazmq.model.loader import load_model_config, load_tokenizer, resolve_model

    source = None
    if vocab_size == 0 or avoid == "auto":
        source = resolve_model(model, load_format)
    if vocab_size == 0:
        assert source is not None
        vocab_size = load_model_config(source).vocab_size
    if avoid != "auto":
        return vocab_size, parse_id_ranges(avoid)
    assert source is not None
    tok = load_tokenizer(source)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    special.update(tok.all_special_ids)
    return vocab_size, tuple(sorted(special))
