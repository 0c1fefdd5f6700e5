#!/usr/bin/env bash
# Two neutral benchmark clients, unmodified, against three servers of the same model on this machine:
#   clients: `vllm bench serve` (../shared/peers/vllm/bench.sh) and NVIDIA AIPerf (scripts/peer_aiperf.sh);
#   servers: sarazmq (sarathi, float32), vLLM's CPU build (float32 safetensors conversion of the same GGUF,
#            ../shared/peers/vllm/serve.sh) and, where it was built, llama.cpp's own server (llama-server:
#            continuous batching over parallel slots, the Q4_1 GGUF with its integer-dot matmuls).
# Each server is started fresh, gets the Poisson workload (INPUT-token random prompts, OUTPUT tokens,
# ignore_eos, RATE req/s, REQUESTS requests) from each client (vllm bench with SEED 0, aiperf with SEED 1:
# different prompts, so the second client finds nothing in the prefix cache), then a saturation run
# (`vllm bench serve --request-rate inf`, SEED 2), and is stopped. A table of all runs is printed at the end
# (and written to OUT/table.md). Run on a quiet machine: ~15 minutes.
#   OUT=peer_clients_out REQUESTS=64 RATE=2 bash scripts/peer_clients.sh
# Needs ../shared/peers/vllm/setup.sh (vLLM venv, tokenizer and fp32 folders) and `scripts/peer_aiperf.sh
# setup`; llama.cpp: LLAMA_SERVER=/path/to/llama-server, skipped when absent. It was built from the
# llama.cpp source vendored in llama-cpp-python's sdist (its wheel builds only the library, not the server):
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/peer/llamacpp-src
#   tar xzf /tmp/peer/llamacpp-src/llama_cpp_python-0.3.36.tar.gz -C /tmp/peer/llamacpp-src
#   cd /tmp/peer/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp
#   cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
#   cmake --build build --target llama-server -j 2      # 12-30 min on 2 cores
# On the Xeon AMX VM (2026-12-05) that GGML_NATIVE build died with SIGILL at its first decode, in
# ggml's AMX kernel (`tilezero`, tinygemm_kernel_amx); this one, without AMX, ran there:
#   cmake -B build-noamx -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON \
#     -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
#     -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
# AVX2 only (the peer for `scripts/cpu_isa.sh avx2` runs, docs/PERF_RESULT.md, 2026-12-06):
#   cmake -B build-avx2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
#     -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
#     -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
# SERVERS="sarazmq vllm llamacpp" picks which run.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${PEER_DIR:-$here/../shared/peers/vllm}"
PEER_ROOT="${PEER_ROOT:-/tmp/peer}"
OUT="${OUT:-$here/peer_clients_out}"
REQUESTS="${REQUESTS:-64}"
RATE="${RATE:-2}"
INPUT="${INPUT:-512}"
OUTPUT="${OUTPUT:-32}"
SAT_REQUESTS="${SAT_REQUESTS:-64}"
PORT="${PORT:-8100}"
SERVERS="${SERVERS:-sarazmq vllm llamacpp}"
LLAMA_SERVER="${LLAMA_SERVER:-}"
py="$here/.venv/bin/python"
mkdir -p "$OUT"
url="http://127.0.0.1:$PORT"

spid=""
stop_server() {
  if [[ -n "$spid" ]]; then
    kill -INT -- "-$spid" 2>/dev/null || kill -INT "$spid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$spid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$spid" 2>/dev/null || true
    spid=""
  fi
  bash "$peer/stop.sh" "$PORT" >/dev/null 2>&1 || true
}
trap stop_server EXIT

wait_health() {
  for _ in $(seq 600); do curl -fsS -m 2 "$url/health" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "no /health on $url" >&2; exit 1
}

start_server() {  # start_server NAME: sets spid (its process group) and model (the served name)
  case "$1" in
    sarazmq)
      setsid "$here/.venv/bin/sarazmq" serve --http-port "$PORT" --scheduler sarathi --dtype float32 \
        --max-model-len 2048 --num-kv-blocks 4096 --max-num-seqs 128 > "$OUT/serve-$1.log" 2>&1 &
      spid=$!; model=smollm2-135m-instruct; wait_health ;;
    vllm)
      spid=$(SERVED_NAME=smollm2 DTYPE=float32 MAX_MODEL_LEN=2048 bash "$peer/serve.sh" "$PORT" \
        "$PEER_ROOT/smollm2-hf-fp32" --max-num-seqs 128)
      model=smollm2 ;;
    llamacpp)
      # 8 parallel slots of 2,048 tokens (continuous batching is on by default), all cores
      spid=$(LLAMA_SERVER="$LLAMA_SERVER" SLOTS=8 bash "$here/scripts/llamacpp_serve.sh" "$PORT" \
        "$OUT/serve-$1.log")
      model=smollm2 ;;
  esac
}

for server in $SERVERS; do
  if [[ "$server" == llamacpp && ! -x "$LLAMA_SERVER" ]]; then
    echo "[clients] no llama-server (LLAMA_SERVER=$LLAMA_SERVER): skipping llama.cpp" >&2; continue
  fi
  echo "[clients] $server: starting" >&2
  start_server "$server"
  MODEL="$model" LABEL="$server" SEED=0 NUM_PROMPTS="$REQUESTS" RATE="$RATE" INPUT_LEN="$INPUT" \
    OUTPUT_LEN="$OUTPUT" RESULT_FILENAME=vllm-bench.json bash "$peer/bench.sh" "$url" "$OUT/$server" \
    > "$OUT/$server-vllm-bench.log" 2>&1
  SEED=1 REQUESTS="$REQUESTS" RATE="$RATE" INPUT="$INPUT" OUTPUT="$OUTPUT" \
    bash "$here/scripts/peer_aiperf.sh" "$url" "$model" "$OUT/$server/aiperf" > "$OUT/$server-aiperf.log" 2>&1
  MODEL="$model" LABEL="$server" SEED=2 NUM_PROMPTS="$SAT_REQUESTS" RATE=inf INPUT_LEN="$INPUT" \
    OUTPUT_LEN="$OUTPUT" RESULT_FILENAME=vllm-bench-sat.json bash "$peer/bench.sh" "$url" "$OUT/$server" \
    > "$OUT/$server-vllm-bench-sat.log" 2>&1
  stop_server
  echo "[clients] $server: done" >&2
done

"$py" - "$OUT" $SERVERS <<'PYEOF' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out, servers = Path(sys.argv[1]), sys.argv[2:]
rows = []
def vb(path):
    d = json.loads(path.read_text())
    return (d["output_throughput"], d["median_ttft_ms"], d["p99_ttft_ms"], d["median_itl_ms"],
            d["p99_itl_ms"], d["median_tpot_ms"], d.get("completed", 0), d.get("failed", 0))
def ap(path):
    d = json.loads(path.read_text()); d = d.get("metrics", d)
    g = lambda tag, k: d.get(tag, {}).get(k, float("nan"))
    return (g("output_token_throughput", "avg"), g("time_to_first_token", "p50"),
            g("time_to_first_token", "p99"), g("inter_chunk_latency", "p50"),
            g("inter_chunk_latency", "p99"), g("inter_token_latency", "p50"),
            int(g("request_count", "avg")), int(d.get("error_request_count", {}).get("avg", 0)))
print("| server | client | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) | done / failed |")
print("|---|---|---|---|---|---|---|")
for s in servers:
    runs = [("vllm bench serve", out / s / "vllm-bench.json", vb),
            ("aiperf", out / s / "aiperf" / "profile_export_aiperf.json", ap),
            ("vllm bench serve, rate inf", out / s / "vllm-bench-sat.json", vb)]
    for client, path, read in runs:
        if not path.is_file():
            continue
        t, ttft50, ttft99, itl50, itl99, tpot, done, failed = read(path)
        print(f"| {s} | {client} | {t:.1f} | {ttft50:.0f} / {ttft99:.0f} | {itl50:.1f} / {itl99:.1f} "
              f"| {tpot:.1f} | {done} / {failed} |")
PYEOF
