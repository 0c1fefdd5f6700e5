"""`python -m sarazmq.cli`."""

import sys
from pathlib import Path

# `python -m` puts the working directory first on sys.path; from a source checkout its
# top-level kernels/ (installed as sarazmq.kernels) would then shadow Hugging Face's
# `kernels` package, which transformers imports where it is installed. Drop it, as
# `python -P` would (the launcher's children run with PYTHONSAFEPATH=1: procs/spawn.py).
if (
    not getattr(sys.flags, "safe_path", False)
    and sys.path
    and (Path(sys.path[0] or ".") / "kernels").is_dir()
):
    del sys.path[0]

from sarazmq.cli import main  # noqa: E402 (after the path fix)

main()
