#!/usr/bin/env bash
# The hybrid target's fast path against its slow path, in one call of the GPU machine (it has no registry):
# build causal-conv1d from its sdist for this GPU's architecture only, install it with the carried
# flash-linear-attention wheels into a private site dir, then time the Qwen3.6-27B-shaped features on the
# slow path, the fast path and the fast path with compiled layers (bench/gpu_bench.py --sections hybrid).
# Run from the repository root:
#   bash bench/hybrid_fast_path.sh WHEEL_DIR [PATHS]
# WHEEL_DIR holds flash_linear_attention-*.whl, fla_core-*.whl and causal_conv1d-*.tar.gz (pip download);
# PATHS defaults to slow,fast,fastcompiled. The build log and results.json go to $OUT. Without restricting
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
read -r sm arch < <(python3 -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b} {a}.{b}")')
tar xzf "$wheels"/causal_conv1d-*.tar.gz -C "$build"
(cd "$build"/causal_conv1d-*/ &&
  python3 "$root/roles/kernels/files/dflash-causal-conv1d-archs" setup.py "$sm" &&
  CAUSAL_CONV1D_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-12}" \
    python3 -m pip wheel --no-build-isolation --no-deps -w "$build/wheel" . >"$out/causal-conv1d-build.log" 2>&1)
echo "causal-conv1d built: $(ls "$build"/wheel)"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl "$build"/wheel/*.whl
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/gpu_bench.py --sections hybrid --hybrid-paths "$paths" \
  --out "$out"
