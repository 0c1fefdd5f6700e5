#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Extra args go to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh"
venv="${VENV:-$here/.venv}"
cd "$here"
"$venv/bin/ruff" check sarazmq kernels procs tests scripts
# the slowest tests listed at the end: the suite should stay under ~15 minutes on 2 cores
# PYTHONSAFEPATH: the checkout root off sys.path (tests/conftest.py says why)
exec env PYTHONSAFEPATH=1 "$venv/bin/python" -m pytest -q --durations=15 "$@"
