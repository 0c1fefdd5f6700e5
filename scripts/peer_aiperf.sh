#!/usr/bin/env bash
# A second benchmark client nobody here wrote: NVIDIA AIPerf (`aiperf profile`, PyPI aiperf 0.13.0), run
# unmodified against ANY OpenAI-compatible server (sarazmq, vLLM CPU, ...) on the workload of
# ../shared/peers/vllm/bench.sh (`vllm bench serve`): random-token prompts of INPUT tokens, OUTPUT tokens each
# (ignore_eos, temperature 0), Poisson arrivals at RATE req/s, REQUESTS requests, streaming /v1/completions.
# It writes aiperf's own exports (profile_export_aiperf.{json,csv}, per-request profile_export.jsonl, log) under
# OUT_DIR (console copy: aiperf-stdout.log; exact command: command.txt) and OUT_DIR/summary.txt, a few numbers
# read back from aiperf's JSON export.
#
#   bash scripts/peer_aiperf.sh setup                      # once: its own venv, $PEER_ROOT/aiperf-venv (~1.2 GB)
#   bash scripts/peer_aiperf.sh URL MODEL_NAME OUT_DIR     # e.g. http://127.0.0.1:8100 smollm2-135m-instruct out/
#   REQUESTS=64 RATE=2 INPUT=512 OUTPUT=32 bash scripts/peer_aiperf.sh ...
#
# MODEL_NAME is the server's served model id (GET URL/v1/models): `sarazmq serve` -> smollm2-135m-instruct,
# ../shared/peers/vllm/serve.sh -> smollm2 (its SERVED_NAME default). The tokenizer is a LOCAL folder
# (TOKENIZER, default $PEER_ROOT/smollm2-hf, made by ../shared/peers/vllm/setup.sh): aiperf builds prompts and
# counts tokens with it, and the run is offline (no hub access: see HF_ENDPOINT below; no server-metrics or
# GPU-telemetry scraping).
# Output token counts are the server's own usage numbers (--use-server-token-count).
#
# aiperf's names differ from vLLM's: aiperf "ITL" = (latency - TTFT) / (tokens - 1) per request = vLLM's TPOT;
# aiperf "inter_chunk_latency" = gaps between streamed chunks = vLLM's ITL. summary.txt prints both.
# SEED (default 0) fixes the prompts, so two servers get the same ones; but a second run against the SAME warm
# server replays prompts it has cached (prefix caching is on in both sarazmq and vLLM): restart the server or
# change SEED between runs (smoke test: TTFT p50 216 ms on a repeat vs 12 s with fresh prompts).
# Nothing here is a dependency of the project or part of its tests: the client lives in its own venv outside
# the repository; this script only drives it.
set -euo pipefail

PEER_ROOT="${PEER_ROOT:-/tmp/peer}"
VENV="${AIPERF_VENV:-$PEER_ROOT/aiperf-venv}"
AIPERF_SPEC="${AIPERF_SPEC:-aiperf==0.13.0}"
TOKENIZER="${TOKENIZER:-$PEER_ROOT/smollm2-hf}"
REQUESTS="${REQUESTS:-64}"
RATE="${RATE:-2}"
INPUT="${INPUT:-512}"
OUTPUT="${OUTPUT:-32}"
SEED="${SEED:-0}"
ARRIVAL="${ARRIVAL:-poisson}"             # vllm bench serve's default (burstiness 1.0); or constant
TIMEOUT_S="${TIMEOUT_S:-600}"             # per request

setup() {  # idempotent: a venv of its own with aiperf; never the project's .venv
  if [[ "$("$VENV/bin/aiperf" --version 2>/dev/null | tail -1)" != *"${AIPERF_SPEC#*==}"* ]]; then
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "$AIPERF_SPEC"
  fi
}

if [[ "${1:-}" == setup ]]; then setup; "$VENV/bin/aiperf" --version; exit 0; fi
URL="${1:?usage: peer_aiperf.sh URL MODEL_NAME OUT_DIR   (or: peer_aiperf.sh setup)}"
MODEL="${2:?usage: peer_aiperf.sh URL MODEL_NAME OUT_DIR}"
OUT_DIR="${3:?usage: peer_aiperf.sh URL MODEL_NAME OUT_DIR}"
URL="${URL%/}"; URL="${URL%/v1}"          # aiperf appends /v1/completions itself
[[ -f "$TOKENIZER/tokenizer.json" || -f "$TOKENIZER/tokenizer_config.json" ]] \
  || { echo "no tokenizer in $TOKENIZER: run ../shared/peers/vllm/setup.sh (or set TOKENIZER=dir)" >&2; exit 1; }
setup
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

# Offline: NOT via HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE. aiperf 0.13.0 treats either (any non-empty value) as
# "load the tokenizer from the HF cache" and calls snapshot_download(name) even for a local folder, which fails
# (HFValidationError: Repo id must be in the form 'repo_name'...). A local folder never reaches the hub (aiperf
# skips alias lookup for paths, transformers loads directories from disk); HF_ENDPOINT at a closed local port
# makes any stray hub call fail at once instead of going out.
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
export HF_ENDPOINT="${HF_ENDPOINT_FOR_AIPERF:-http://127.0.0.1:9}" HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
# --num-dataset-entries = REQUESTS: every request its own prompt (aiperf reuses a pool of 100 by default).
# --workers-max/--record-processors 1: aiperf is several processes; keep it small beside a 2-core server.
args=(
  profile --model "$MODEL" --url "$URL" --endpoint-type completions --streaming
  --tokenizer "$TOKENIZER"
  --prompt-corpus random --isl "$INPUT" --isl-stddev 0 --osl "$OUTPUT" --osl-stddev 0
  --extra-inputs ignore_eos:true --extra-inputs temperature:0
  --use-server-token-count
  --request-rate "$RATE" --arrival-pattern "$ARRIVAL" --request-count "$REQUESTS"
  --num-dataset-entries "$REQUESTS" --random-seed "$SEED"
  --request-timeout-seconds "$TIMEOUT_S"
  --workers-max 1 --record-processors 1
  --no-server-metrics --no-gpu-telemetry --ui-type none
  --artifact-dir "$OUT_DIR"
)
printf '%q ' "$VENV/bin/aiperf" "${args[@]}" > "$OUT_DIR/command.txt"; echo >> "$OUT_DIR/command.txt"
echo "[aiperf] $(cat "$OUT_DIR/command.txt")" >&2
"$VENV/bin/aiperf" "${args[@]}" 2>&1 | tee "$OUT_DIR/aiperf-stdout.log" | grep -v -E '^\s*$' | tail -n 40

JSON="$OUT_DIR/profile_export_aiperf.json"
[[ -f "$JSON" ]] || JSON="$(find "$OUT_DIR" -name profile_export_aiperf.json | head -1)"
[[ -n "$JSON" && -f "$JSON" ]] || { echo "[aiperf] no profile_export_aiperf.json under $OUT_DIR" >&2; exit 1; }
"$VENV/bin/python" - "$JSON" "$URL" "$MODEL" "$REQUESTS" "$RATE" "$INPUT" "$OUTPUT" > "$OUT_DIR/summary.txt" <<'EOF'
import json, sys
path, url, model, n, rate, isl, osl = sys.argv[1:]
d = json.load(open(path))
m = d.get("metrics", d)   # aiperf 0.13: {tag: {"unit", "avg", "p50", "p99", ...}, ...} at top level

def get(tag, stat):
    v = (m.get(tag) or {}).get(stat)
    if v is None and tag == "error_request_count" and "request_count" in m:
        v = 0
    return "-" if v is None else f"{v:.2f}"

print(f"aiperf {d.get('aiperf_version', '0.13.0')}  {url}  model={model}")
print(f"workload: {n} requests, {rate} req/s poisson, random {isl} in / {osl} out, ignore_eos, streaming /v1/completions")
rows = [
    ("requests completed", "request_count", "avg", ""),
    ("errors", "error_request_count", "avg", ""),   # absent from the export when there are none
    ("request error rate", "request_error_rate", "avg", "%"),
    ("request throughput", "request_throughput", "avg", "req/s"),
    ("output tok/s", "output_token_throughput", "avg", "tok/s"),
    ("input tokens mean", "input_sequence_length", "avg", "tok"),
    ("output tokens mean", "output_sequence_length", "avg", "tok"),
    ("TTFT p50", "time_to_first_token", "p50", "ms"),
    ("TTFT p99", "time_to_first_token", "p99", "ms"),
    ("ITL p50 (aiperf ITL = vLLM TPOT)", "inter_token_latency", "p50", "ms"),
    ("ITL p99 (aiperf ITL = vLLM TPOT)", "inter_token_latency", "p99", "ms"),
    ("chunk gap p50 (= vLLM ITL)", "inter_chunk_latency", "p50", "ms"),
    ("chunk gap p99 (= vLLM ITL)", "inter_chunk_latency", "p99", "ms"),
    ("E2E latency p50", "request_latency", "p50", "ms"),
    ("E2E latency p99", "request_latency", "p99", "ms"),
    ("benchmark duration", "benchmark_duration", "avg", "s"),
]
for label, tag, stat, unit in rows:
    print(f"{label:34s} {get(tag, stat):>10s} {unit}")
EOF
cat "$OUT_DIR/summary.txt"
