"""A stats or prefix-cache-reset question asked of every engine instance, and the answer.

With one instance the client gets that instance's answer as it is. With several
(data-parallel replicas), the answer adds up the counters that add up (requests,
blocks, iterations, prefix-cache tokens), keeps each replica's own answer under
"replicas" (in instance order, with "instance" and "alive"), and tags each iteration
record with the instance that ran it; a reset succeeds only where every replica reset.
Step numbers are per replica: `iterations_from` is passed to each as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sarazmq.protocol.client import ResetPrefixCacheRequest, StatsRequest
from sarazmq.protocol.engine import ResetPrefixCache, StatsQuery

#: the stats fields that are sums over replicas
ADDITIVE = (
    "num_waiting",
    "num_running",
    "num_free_blocks",
    "num_total_blocks",
    "num_iterations",
    "num_preemptions",
    "num_finished",
    "num_cached_blocks",
    "num_evictions",
    "prefix_cache_requests",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_preempted_requests",
    "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits",
    "kv_pulls",
    "kv_pull_bytes",
    "kv_pull_seconds",
    "num_parked",
)
#: separates an engine request id from the instance a fan-out part was sent to
PART_SEP = "#"


def part_id(engine_id: str, instance: int) -> str:
    return f"{engine_id}{PART_SEP}{instance}"


def split_part_id(part: str) -> tuple[str, int] | None:
    """(engine id, instance) of a part id; None when it is not one."""
    engine_id, sep, tail = part.rpartition(PART_SEP)
    if not sep or not tail.isdigit():
        return None
    return engine_id, int(tail)


@dataclass
class Fanout:
    """One client question sent to `waiting` instances; `answers` collected so far."""

    identity: bytes
    client_rid: str
    reset: bool
    waiting: set[int]
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    num_instances: int = 1

    def answer(self, instance: int, stats: dict[str, Any]) -> bool:
        """Records one instance's answer; True once every instance asked has answered."""
        if instance in self.waiting:
            self.waiting.discard(instance)
            self.answers[instance] = stats
        return not self.waiting

    def give_up(self, instance: int, reason: str) -> bool:
        """An instance died before answering; True once nothing else is awaited."""
        return self.answer(instance, {"dead": reason})

    def merged(self) -> dict[str, Any]:
        """The client's answer (see the module docstring)."""
        if self.num_instances == 1:
            return dict(next(iter(self.answers.values()), {}))
        parts = [self.answers[i] for i in sorted(self.answers)]
        if self.reset:
            errors = [p.get("error") or p.get("dead", "") for p in parts if not p.get("reset")]
            return {
                "reset": not errors,
                "error": "; ".join(e for e in errors if e),
                "replicas": [{"instance": i, **self.answers[i]} for i in sorted(self.answers)],
            }
        out: dict[str, Any] = {}
        live = [p for p in parts if "dead" not in p]
        for key in ADDITIVE:
            out[key] = sum(p.get(key, 0) for p in live)
        if live:  # the settings every replica shares
            for key, value in live[0].items():
                if key not in out and key != "iterations":
                    out[key] = value
        iterations = []
        for i in sorted(self.answers):
            for rec in self.answers[i].get("iterations", []):
                iterations.append({**rec, "instance": i})
        if iterations or any("iterations" in p for p in parts):
            out["iterations"] = iterations
        out["replicas"] = [
            {
                "instance": i,
                "alive": "dead" not in self.answers[i],
                **{k: v for k, v in self.answers[i].items() if k != "iterations"},
            }
            for i in sorted(self.answers)
        ]
        return out


def fan_out(
    identity: bytes,
    msg: StatsRequest | ResetPrefixCacheRequest,
    engine_id: str,
    live: list[int],
    num_instances: int,
) -> tuple[Fanout, list[tuple[int, StatsQuery | ResetPrefixCache]]]:
    """A client's question as one part per live instance (ids `part_id(engine_id, i)`),
    and the `Fanout` collecting their answers; an instance that is down answers at once
    (it is "dead" in the merged reply)."""
    reset = isinstance(msg, ResetPrefixCacheRequest)
    fan = Fanout(identity, msg.request_id, reset, set(live), num_instances=num_instances)
    for i in range(num_instances):
        if i not in fan.waiting:
            fan.answers[i] = {"dead": "this replica is down"}
    parts: list[tuple[int, StatsQuery | ResetPrefixCache]] = []
    for i in live:
        pid = part_id(engine_id, i)
        parts.append(
            (
                i,
                ResetPrefixCache(request_id=pid)
                if reset
                else StatsQuery(request_id=pid, iterations_from=msg.iterations_from),
            )
        )
    return fan, parts
