"""A disk cache of tokenizers converted from GGUF files.

transformers rebuilds a fast tokenizer from a GGUF's vocab and merges on every load,
which takes seconds (and every deployment process loads one). The converted tokenizer
is saved once under $SARAZMQ_CACHE (default ~/.cache/sarazmq), keyed by the GGUF's
path, size and mtime, and later loads read the saved tokenizer.json instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    return Path(os.environ.get("SARAZMQ_CACHE") or Path.home() / ".cache" / "sarazmq")


def gguf_tokenizer_key(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def cached_gguf_tokenizer(gguf_path: str) -> Path | None:
    """The folder of the GGUF's converted tokenizer (tokenizer.json, tokenizer_config.json)
    if an earlier load cached it, else None."""
    target = cache_root() / "tokenizers" / gguf_tokenizer_key(gguf_path)
    return target if (target / "tokenizer.json").is_file() else None


def load_gguf_tokenizer_cached(directory: str, gguf_file: str) -> Any:
    """Loads the GGUF's tokenizer, converting and caching it on first use."""
    from transformers import AutoTokenizer

    target = cache_root() / "tokenizers" / gguf_tokenizer_key(os.path.join(directory, gguf_file))
    if (target / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target))
        except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt below
            shutil.rmtree(target, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=target.parent, prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)  # atomic: concurrent processes never see half a cache
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer
