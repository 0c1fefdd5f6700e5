"""Reading the replicas of a data-parallel deployment out of a stats reply."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: what a summary keeps of each replica's stats
REPLICA_FIELDS = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks")


def replica_summaries(replicas: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per replica of a stats reply's "replicas": its instance, whether it is up, and its
    queues and KV pool (0 for one that is down)."""
    out = []
    for r in replicas:
        alive = bool(r.get("alive", "dead" not in r))
        out.append(
            {
                "instance": int(r.get("instance", 0)),
                "alive": alive,
                **{k: int(r.get(k, 0)) if alive else 0 for k in REPLICA_FIELDS},
            }
        )
    return out
