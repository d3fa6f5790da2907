#!/usr/bin/env bash
# GPU check of the topologies (not part of pytest): run on a 2-GPU machine from the repository root, e.g.
#   device run, kind nvidia-h200-x2:  bash tests/distributed/gpu_topology_check.sh
# Trains the small real-shaped config colocated on 1 and 2 GPUs, then as 1 target + 1 drafter rank (NCCL),
# and prints each run's last log line (tokens/s) and exit status.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-topology}"
cfg=tests/distributed/configs/gpu-small.yaml
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
run() {
  local name=$1; shift
  local t0=$SECONDS
  python3 -m dflash train "$cfg" "output_dir=$out/$name" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0))s; $(grep -c '^step' "$out/$name.log") log lines"
  grep -E '^step|dflash: error|Root Cause' "$out/$name.log" | tail -2
}
mkdir -p "$out"
run colocated-1 topology.nproc=1
run colocated-2 topology.nproc=2
run disaggregated-1t1d topology.mode=disaggregated 'topology.target_gpus=[0]' 'topology.drafter_gpus=[1]'
