"""The frontend's table of engine instances: who is up and how loaded each one is.

Each instance's scheduler reports its load (`InstanceLoad`: queued prefill tokens,
running requests, KV use, and how many requests it has received). Reports lag the
routing: the table also counts what it sent to each instance since the requests a
report includes, so two requests routed between reports do not both see the same
"idle" instance.

The load a router compares is the expected prefill wait of a new request there, in
iterations: the prefill tokens ahead of it (queued, plus its own not found in the cache)
over what an iteration has left for prefill after its running decodes (Sarathi's token
budget minus one token per decode).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sarazmq.protocol.engine import InstanceLoad

#: an instance whose KV pool is this full loses to any that is not (its new requests
#: would wait for blocks or preempt others)
KV_FULL = 0.95
#: ROLES: an instance serves whole requests (mixed), or one phase of them
ROLES = ("mixed", "prefill", "decode")


@dataclass
class InstanceState:
    """One instance as the router sees it."""

    index: int
    role: str
    token_budget: int
    kv_total_blocks: int
    alive: bool = True
    report: InstanceLoad | None = None
    num_sent: int = 0
    # (sequence number of the AddRequest, its prompt tokens) sent after the last report's
    # num_added, oldest first
    pending: deque[tuple[int, int]] = field(default_factory=deque)
    pending_tokens: int = 0

    @property
    def num_running(self) -> int:
        return self.report.num_running if self.report is not None else 0

    @property
    def queued_tokens(self) -> int:
        """Prefill tokens this instance has to compute before a new request's."""
        queued = self.report.queued_prefill_tokens if self.report is not None else 0
        return queued + self.pending_tokens

    @property
    def kv_use(self) -> float:
        if self.report is None or not self.kv_total_blocks:
            return 0.0
        return self.report.kv_used_blocks / self.kv_total_blocks

    def prefill_iterations(self, own_tokens: int = 0) -> float:
        """Iterations until a new request with `own_tokens` to compute is prefilled."""
        free = max(self.token_budget // 8, self.token_budget - self.num_running)
        return (self.queued_tokens + own_tokens) / max(1, free)

    def rank(self, own_tokens: int = 0) -> tuple[bool, float, int]:
        """Sort key: a full KV pool last, then the shortest prefill wait, then the fewest
        running decodes (each slows every iteration)."""
        return (self.kv_use >= KV_FULL, self.prefill_iterations(own_tokens), self.num_running)


class InstanceTable:
    """Every instance and its load (see the module docstring)."""

    def __init__(
        self, token_budgets: list[int], kv_blocks: list[int], roles: list[str] | None = None
    ) -> None:
        if len(token_budgets) != len(kv_blocks) or not token_budgets:
            raise ValueError("one token budget and one KV pool size per instance, at least one")
        roles = roles or ["mixed"] * len(token_budgets)
        for role in roles:
            if role not in ROLES:
                raise ValueError(f"unknown instance role {role!r}; choose one of {ROLES}")
        self.instances = [
            InstanceState(i, role, budget, blocks)
            for i, (role, budget, blocks) in enumerate(zip(roles, token_budgets, kv_blocks))
        ]

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, index: int) -> InstanceState:
        return self.instances[index]

    def alive_mask(self, role: str = "mixed") -> int:
        """Bitmask of the live instances of `role`."""
        mask = 0
        for inst in self.instances:
            if inst.alive and inst.role == role:
                mask |= 1 << inst.index
        return mask

    def on_sent(self, index: int, prompt_tokens: int) -> None:
        """An AddRequest of `prompt_tokens` to compute was sent to `index`."""
        inst = self.instances[index]
        inst.num_sent += 1
        inst.pending.append((inst.num_sent, prompt_tokens))
        inst.pending_tokens += prompt_tokens

    def on_report(self, load: InstanceLoad) -> None:
        """A scheduler's report; a report from an instance not in the table is ignored."""
        if not 0 <= load.instance < len(self.instances):
            return
        inst = self.instances[load.instance]
        inst.report = load
        inst.kv_total_blocks = load.kv_total_blocks or inst.kv_total_blocks
        while inst.pending and inst.pending[0][0] <= load.num_added:
            _, tokens = inst.pending.popleft()
            inst.pending_tokens -= tokens

    def mark_down(self, index: int) -> None:
        self.instances[index].alive = False

    def mark_up(self, index: int) -> None:
        """A (re)started instance: alive, empty, nothing sent to it yet."""
        inst = self.instances[index]
        inst.alive = True
        inst.report = None
        inst.num_sent = 0
        inst.pending.clear()
        inst.pending_tokens = 0

    def loads(self) -> list[dict[str, object]]:
        """Per instance, what the router knows (for stats and /metrics)."""
        return [
            {
                "instance": inst.index,
                "role": inst.role,
                "alive": inst.alive,
                "num_running": inst.num_running,
                "num_waiting": inst.report.num_waiting if inst.report is not None else 0,
                "queued_prefill_tokens": inst.queued_tokens,
                "kv_use": round(inst.kv_use, 4),
                "num_sent": inst.num_sent,
            }
            for inst in self.instances
        ]
