#!/usr/bin/env bash
# Runs a command with the CPU instruction set capped, ours and torch's alike, so an AVX2
# (or AVX-512-without-AMX) machine's code paths run and are measured on a bigger CPU:
#   bash scripts/cpu_isa.sh avx2 .venv/bin/python scripts/bench_engine.py --dtype float32
# Caps: native (no cap), avx512 (no AMX), avx2 (x86-64-v3: AVX2 + FMA, no AVX-512/VNNI).
# It is an emulation: the core, caches and memory stay this machine's, so a capped run
# tells which kernels run and how they compare with each other, not an EPYC's speed.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: cpu_isa.sh native|avx512|avx2 COMMAND [ARG...]" >&2
  exit 2
fi
cap="$1"
shift
case "$cap" in
  native)  # lifts a cap the environment already had
    unset SARAZMQ_CPU_ISA ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS ATEN_CPU_CAPABILITY
    ;;
  avx512)
    # our kernels (kernels/native.py), oneDNN (bf16/f32 matmuls), MKL (f32 GEMM)
    export SARAZMQ_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
    export MKL_ENABLE_INSTRUCTIONS=AVX512 ATEN_CPU_CAPABILITY=avx512
    ;;
  avx2)
    export SARAZMQ_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    export MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
    ;;
  *)
    echo "cpu_isa.sh: unknown cap '$cap' (expected native, avx512 or avx2)" >&2
    exit 2
    ;;
esac
exec "$@"
