#!/usr/bin/env bash
# sarazmq against llama.cpp's own server on the same GGUF file: scripts/peer_serving.sh's three
# workloads (Azure code and conversation windows, saturation) and client, PEERS=llamacpp.
#   LLAMA_SERVER=/path/to/llama-server OUT=peer_llamacpp bash scripts/peer_llamacpp.sh
# PEERS="vllm llamacpp" (environment) runs vLLM's CPU build in the same run as well.
set -euo pipefail
PEERS="${PEERS:-llamacpp}" exec bash "$(dirname "${BASH_SOURCE[0]}")/peer_serving.sh" "$@"
