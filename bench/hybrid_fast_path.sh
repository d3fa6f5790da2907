#!/usr/bin/env bash
# The hybrid target's fast path against its slow path, in one call of the GPU machine (it has no registry):
# build causal-conv1d from its sdist for this GPU's architecture only, install it with the carried
# flash-linear-attention wheels into a private site dir, then time the Qwen3.6-27B-shaped features on the
# slow path, the fast path and the fast path with compiled layers (bench/gpu_bench.py --sections hybrid).
# Run from the repository root:
#   bash bench/hybrid_fast_path.sh WHEEL_DIR [PATHS]
# WHEEL_DIR holds flash_linear_attention-*.whl, fla_core-*.whl and either causal_conv1d-*.tar.gz (pip download)
# or a causal-conv1d wheel built by an earlier run (causal_conv1d-*.whl, or its parts causal_conv1d-*.whl.part-*,
# which this script writes to $OUT because the wheel is larger than what one file from the machine may be).
# PATHS defaults to slow,fast,fastcompiled. results.json goes to $OUT (and the build log's tail to stdout on failure). Without restricting
# causal-conv1d's setup.py to the GPU's architecture (roles/kernels/files/dflash-causal-conv1d-archs) its
# build compiles every architecture and takes far longer than a call.
set -euo pipefail
export PYTHONUNBUFFERED=1
wheels="$(cd "${1:?usage: bench/hybrid_fast_path.sh WHEEL_DIR [PATHS]}" && pwd)"
paths="${2:-slow,fast,fastcompiled}"
out="${OUT:-/tmp/hybrid-out}"
root="$PWD"
build="$(mktemp -d)"
site="$(mktemp -d)"
mkdir -p "$out" "$build/wheel"
shopt -s nullglob
parts=("$wheels"/causal_conv1d-*.whl.part-*)
built=("$wheels"/causal_conv1d-*.whl)
if ((${#built[@]})); then
  cp "${built[@]}" "$build/wheel/"
elif ((${#parts[@]})); then
  name="$(basename "${parts[0]}")"
  cat "${parts[@]}" >"$build/wheel/${name%.part-*}"
else
  read -r sm arch < <(python3 -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b} {a}.{b}")')
  tar xzf "$wheels"/causal_conv1d-*.tar.gz -C "$build"
  t0=$SECONDS
  (cd "$build"/causal_conv1d-*/ &&
    python3 "$root/roles/kernels/files/dflash-causal-conv1d-archs" setup.py "$sm" &&
    CAUSAL_CONV1D_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-16}" \
      python3 -m pip wheel --no-build-isolation --no-deps -w "$build/wheel" . >"$build/build.log" 2>&1) ||
    { tail -40 "$build/build.log"; exit 1; }
  echo "causal-conv1d built in $((SECONDS - t0)) s: $(ls -l "$build"/wheel)"
  for w in "$build"/wheel/*.whl; do split -b 15M -d "$w" "$out/$(basename "$w").part-"; done
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/flash_linear_attention-*.whl "$wheels"/fla_core-*.whl \
  "$build"/wheel/*.whl
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/gpu_bench.py --sections hybrid --hybrid-paths "$paths" \
  --out "$out"
