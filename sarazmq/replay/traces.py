"""Readers for the real request traces kept in `../shared/traces/`.

Every reader streams its file with the standard library (csv / json) and returns one
`TraceRow` per request, in file order:

- Azure LLM inference trace 2023 (CSV: TIMESTAMP, ContextTokens, GeneratedTokens). The
  TIMESTAMP has seven fractional digits (`2023-11-16 18:15:46.6805900`), more than
  `datetime` parses, so whole seconds and the fraction are handled apart; arrival_s is
  relative to the first row.
- Mooncake FAST'25 traces (JSONL: timestamp in ms, input_length, output_length, hash_ids).
  hash_ids has one id per 512-token block of the prompt; equal ids mean a shared prefix.
- Sarathi-Serve's processed ShareGPT lengths (CSV: num_prefill_tokens, num_decode_tokens,
  ...). No timestamps: arrival_s is None and the caller picks an arrival process.
"""

from __future__ import annotations

import calendar
import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE_KINDS = ("azure", "mooncake", "sharegpt")

#: Prompt tokens covered by one Mooncake hash id.
MOONCAKE_BLOCK_TOKENS = 512

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_SHAREGPT_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace.

    arrival_s: seconds since the trace's first request (None when the trace has no times).
    input_tokens / output_tokens: prompt and generated lengths as recorded.
    hash_ids: prefix-block ids (Mooncake only; empty otherwise).
    """

    arrival_s: float | None
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def _parse_int(value: str, field: str, where: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {field}={value!r} is not an integer") from None


def _parse_azure_timestamp(value: str, where: str) -> tuple[int, float]:
    """`YYYY-MM-DD HH:MM:SS[.fffffff]` -> (whole seconds since the epoch, fraction).

    The fraction is kept apart so that differences stay exact to the seventh digit; the
    naive time is read as UTC so that no daylight-saving jump enters a difference.
    """
    head, _, frac = value.strip().partition(".")
    try:
        whole = calendar.timegm(datetime.fromisoformat(head).timetuple())
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP={value!r} is not 'YYYY-MM-DD HH:MM:SS.f'") from None
    if frac and not frac.isdigit():
        raise ValueError(f"{where}: TIMESTAMP={value!r} has a non-numeric fraction")
    return whole, float("0." + frac) if frac else 0.0


def _check_columns(header: list[str] | None, needed: tuple[str, ...], path: Path) -> None:
    missing = [c for c in needed if c not in (header or [])]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; header is {header}")


def read_azure(path: str | Path) -> list[TraceRow]:
    """Read an Azure LLM inference trace (2023) CSV."""
    path = Path(path)
    rows: list[TraceRow] = []
    first: tuple[int, float] | None = None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        _check_columns(reader.fieldnames, _AZURE_COLUMNS, path)
        for line, rec in enumerate(reader, start=2):
            where = f"{path}:{line}"
            whole, frac = _parse_azure_timestamp(rec["TIMESTAMP"], where)
            if first is None:
                first = (whole, frac)
            rows.append(
                TraceRow(
                    arrival_s=(whole - first[0]) + (frac - first[1]),
                    input_tokens=_parse_int(rec["ContextTokens"], "ContextTokens", where),
                    output_tokens=_parse_int(rec["GeneratedTokens"], "GeneratedTokens", where),
                )
            )
    return rows


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """Read a Mooncake JSONL trace; arrival_s = (timestamp - first timestamp) / 1000."""
    path = Path(path)
    rows: list[TraceRow] = []
    first_ms: float | None = None
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{line}"
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            for key in ("timestamp", "input_length", "output_length"):
                if not isinstance(rec.get(key), (int, float)) or isinstance(rec.get(key), bool):
                    raise ValueError(f"{where}: field {key!r} missing or not a number")
            ts = float(rec["timestamp"])
            if first_ms is None:
                first_ms = ts
            hash_ids = rec.get("hash_ids", [])
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
                raise ValueError(f"{where}: field 'hash_ids' is not a list of integers")
            rows.append(
                TraceRow(
                    arrival_s=(ts - first_ms) / 1000.0,
                    input_tokens=int(rec["input_length"]),
                    output_tokens=int(rec["output_length"]),
                    hash_ids=tuple(hash_ids),
                )
            )
    return rows


def read_sharegpt(path: str | Path) -> list[TraceRow]:
    """Read Sarathi-Serve's ShareGPT lengths CSV (no timestamps)."""
    path = Path(path)
    rows: list[TraceRow] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        _check_columns(reader.fieldnames, _SHAREGPT_COLUMNS, path)
        for line, rec in enumerate(reader, start=2):
            where = f"{path}:{line}"
            rows.append(
                TraceRow(
                    arrival_s=None,
                    input_tokens=_parse_int(rec["num_prefill_tokens"], "num_prefill_tokens", where),
                    output_tokens=_parse_int(rec["num_decode_tokens"], "num_decode_tokens", where),
                )
            )
    return rows


def detect_kind(path: str | Path) -> str:
    """Guess a trace's kind from its extension and header line."""
    path = Path(path)
    with path.open(newline="") as f:
        first = f.readline().strip()
    if path.suffix in (".jsonl", ".json") or first.startswith("{"):
        return "mooncake"
    header = next(csv.reader([first]), [])
    if all(c in header for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in header for c in _SHAREGPT_COLUMNS):
        return "sharegpt"
    raise ValueError(
        f"{path}: cannot tell the trace kind from header {header}; pass kind= one of {TRACE_KINDS}"
    )


_READERS = {"azure": read_azure, "mooncake": read_mooncake, "sharegpt": read_sharegpt}


def load_trace(path: str | Path, kind: str = "auto") -> list[TraceRow]:
    """Read a whole trace file. kind: "auto" (from extension/header) or one of TRACE_KINDS."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace path {str(path)!r} is not a file")
    if kind == "auto":
        kind = detect_kind(path)
    if kind not in _READERS:
        raise ValueError(f"kind={kind!r} is not 'auto' or one of {TRACE_KINDS}")
    return _READERS[kind](path)
