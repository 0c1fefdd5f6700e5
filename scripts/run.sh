#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then starts a multi-process deployment of the
# default model and chats with it (a one-shot `generate` when there is no terminal).
# Extra args go to the command, e.g. `bash scripts/run.sh --scheduler vllm`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh" >&2
venv="${VENV:-$here/.venv}"
if [ -t 0 ] && [ -t 1 ]; then
  exec "$venv/bin/sarazmq" chat "$@"
else
  exec "$venv/bin/sarazmq" generate "${PROMPT:-Explain in two sentences why the sky is blue.}" "$@"
fi
