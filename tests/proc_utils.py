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
