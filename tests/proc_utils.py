"""Process helpers shared by the multi-process tests."""

from __future__ import annotations

import psutil


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (zombies count as gone: their parent just has not reaped them)."""
    living = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living


def sarazmq_children(pid: int) -> dict[int, str]:
    """pid -> command line of every sarazmq process descending from `pid` (no one else's)."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "sarazmq.procs." in cmd:
            out[p.pid] = cmd
    return out
