"""Where the GPU operator profiles (Vidur's measured tables) are read from.

The tables ship inside the package (`sarazmq/perf/data/vidur`, MIT, provenance in its
README), so an installed wheel simulates A100/H100 as a checkout does;
$SARAZMQ_GPU_PROFILES points at another copy (tests, newer profiles).
"""

from __future__ import annotations

import os
from pathlib import Path

#: names another Vidur copy (a folder with data/profiling/...)
PROFILES_ENV = "SARAZMQ_GPU_PROFILES"
BUNDLED_PROFILES = Path(__file__).resolve().parent / "data" / "vidur"


def profiles_root() -> Path:
    """The Vidur copy in use: $SARAZMQ_GPU_PROFILES, else the one in the package."""
    env = os.environ.get(PROFILES_ENV)
    return Path(env) if env else BUNDLED_PROFILES
