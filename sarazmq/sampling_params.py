"""Per-request sampling parameters.

`SamplingParams` is a msgspec Struct so that it crosses process boundaries as-is
(client -> frontend -> scheduler -> workers) with no pickle. Validation runs in
`__post_init__`, which msgspec also calls on decode, so a bad value arriving over a
socket is rejected the same way as one built in Python: an `InvalidRequestError` naming
the field (msgspec keeps it as the decode error's `__cause__`).
"""

from __future__ import annotations

import math

import msgspec

from sarazmq.validation import InvalidRequestError

MAX_LOGPROBS = 20
#: ints travel as msgpack int64 between processes
MAX_INT = 2**63 - 1
MAX_CACHE_SALT_CHARS = 1024


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p / top_k / min_p: nucleus, top-k (-1 = off) and min-p (relative to the top
        token's probability) filtering, applied after temperature.
    seed: makes sampling reproducible per request, independent of batch composition.
    max_tokens / min_tokens: output length bounds (EOS and stop ids are ignored until
        min_tokens are out).
    stop: strings that end the request; the matched string is not part of the output.
    stop_token_ids: token ids that end the request (the id is not part of the text).
    ignore_eos: keep going past EOS (benchmarks).
    repetition_penalty: >1 discourages any token seen in prompt or output (HF semantics).
    presence_penalty / frequency_penalty: subtracted once / per occurrence for tokens in
        the output so far (OpenAI semantics).
    logprobs: number of top log-probabilities to return for each sampled token (plus the
        sampled token's own); None = none.
    cache_salt: extra key of the prefix cache: requests reuse each other's cached KV
        only when their salts are equal (tenants that must not share pass distinct
        salts; None = the shared default). It never changes the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.temperature >= 0.0 and math.isfinite(self.temperature),
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 = greedy)",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(
            self.top_k == -1 or 1 <= self.top_k <= MAX_INT, "top_k", self.top_k, "-1 (off) or >= 1"
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "[0, 2**63)")
        _check(1 <= self.max_tokens <= MAX_INT, "max_tokens", self.max_tokens, "[1, 2**63)")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"[0, max_tokens={self.max_tokens}]",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "a list of non-empty strings",
        )
        _check(
            all(0 <= t <= MAX_INT for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids >= 0",
        )
        _check(
            0.0 < self.repetition_penalty <= 100.0 and math.isfinite(self.repetition_penalty),
            "repetition_penalty",
            self.repetition_penalty,
            "(0, 100]",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "[-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "[-2, 2]",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            self.logprobs,
            f"None or [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
            "cache_salt",
            self.cache_salt,
            f"None or a string of 1 to {MAX_CACHE_SALT_CHARS} characters",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(
            f"SamplingParams.{field}={value!r} is out of range; allowed: {allowed}", field
        )
