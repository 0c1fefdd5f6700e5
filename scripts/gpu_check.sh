#!/usr/bin/env bash
# The GPU path's check, one script for a lent device (docs/GPU.md): sets up a CUDA venv
# (scripts/setup.sh picks torch's CUDA build where nvidia-smi sees a GPU), tries a
# flash-attn binary wheel (never a source build: that takes longer than the device is
# lent), then runs scripts/gpu_check.py (device limits, kernels against the torch
# reference, exactness against the CPU float32 path, a dummy Llama-3-8B's speed against
# its rooflines) and the replay of one short Azure conversation window on the device.
#
#   bash scripts/gpu_check.sh [REPORT_DIR]     (default: $OUT, else ./gpu_check)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_ARCH=smollm2-135m bash scripts/gpu_check.sh /tmp/gc
#       runs the same steps on a CPU (Triton under its interpreter): the script's own test
#
# Budget: under 8 minutes on one H100/H200 once the packages are installed; each step has
# its own timeout so that a hang costs that step only, and the report keeps what finished.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
report_dir="${1:-${OUT:-$here/gpu_check}}"
device="${GPU_CHECK_DEVICE:-cuda}"
arch="${GPU_CHECK_ARCH:-llama-3-8b}"
mkdir -p "$report_dir"
log="$report_dir/gpu_check.log"
: >"$log"
step() { echo "== $*" | tee -a "$log"; }

if [ "$device" = cuda ]; then
  nvidia-smi 2>&1 | tee -a "$log" | head -15
  export VENV="${VENV:-$here/.venv-gpu}"
  export SARAZMQ_EXTRAS="${SARAZMQ_EXTRAS:-dev}"
  step "setup ($VENV)"
  timeout 300 bash "$here/scripts/setup.sh" 2>&1 | tee -a "$log" | tail -3
  py="$VENV/bin/python"
  step "flash-attn (binary wheel only)"
  timeout 90 "$py" -m pip install -q --only-binary=:all: flash-attn 2>&1 | tail -2 | tee -a "$log" \
    || echo "flash-attn: no binary wheel; the check runs Triton only" | tee -a "$log"
  quick=()
  requests=24
else
  py="${PYTHON:-$here/.venv/bin/python}"
  export TRITON_INTERPRET=1
  quick=(--quick)
  requests=4
fi

step "gpu_check.py --device $device --arch $arch"
timeout 360 "$py" "$here/scripts/gpu_check.py" --device "$device" --arch "$arch" "${quick[@]}" \
  --out "$report_dir/report.md" 2>&1 | tee -a "$log"
check_rc=${PIPESTATUS[0]}

step "replay of an Azure conversation window on $device"
trace="$here/../shared/traces/azure_llm_2023_conv.csv"
[ -f "$trace" ] || trace=uniform  # a fresh machine without the traces: a synthetic load
timeout 180 "$(dirname "$py")/sarazmq" replay "$trace" --device "$device" --max-requests "$requests" \
  --start 9000 --max-input-tokens 1024 --max-output-tokens 64 --qps 4 \
  --output-dir "$report_dir/replay" >"$report_dir/replay.txt" 2>&1
replay_rc=$?
tail -25 "$report_dir/replay.txt" | tee -a "$log"
{
  echo
  echo "## Replay of $requests requests at 4 req/s (exit $replay_rc)"
  echo
  echo '```'
  tail -25 "$report_dir/replay.txt"
  echo '```'
} >>"$report_dir/report.md"
step "done: gpu_check.py exit $check_rc, replay exit $replay_rc; report $report_dir/report.md"
[ "$check_rc" = 0 ] && [ "$replay_rc" = 0 ]
