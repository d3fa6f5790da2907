#!/usr/bin/env bash
# GPU check of the topologies (not part of pytest): run on a 2-GPU machine from the repository root, e.g.
#   device run, kind nvidia-h200-x2:  bash tests/distributed/gpu_topology_check.sh [CONFIG] [RUNS...]
# Trains CONFIG (default: the Qwen3-8B-shaped gpu-8b.yaml) colocated on 1 and 2 GPUs, then as 1 target +
# 1 drafter rank (NCCL); on 3 GPUs also a target split over 2 layer stages (named run layer-split-2s1d).
# Prints and writes to $OUT/topology.txt each run's exit status, wall time and last
# metrics record (tokens/s, MFU, share of time spent obtaining inputs); all logs go to $OUT/topology-logs.txt.
# Run outputs (checkpoints) stay under $RUNS_DIR (default /tmp/gpu-topology), not in $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-topology-out}"
runs="${RUNS_DIR:-/tmp/gpu-topology}"
cfg="${1:-tests/distributed/configs/gpu-8b.yaml}"
shift || true
wanted="${*:-colocated-1 colocated-2 disaggregated-1t1d}"
per_run_limit="${PER_RUN_LIMIT_S:-240}"
mkdir -p "$out" "$runs"
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())' | tee -a "$out/topology.txt"
run() {
  local name=$1; shift
  case " $wanted " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout -k 15 -s TERM "$per_run_limit" python3 -m dflash train "$cfg" "output_dir=$runs/$name" "$@" >"$runs/$name.log" 2>&1
  local rc=$?
  {
    echo "== $name: exit $rc in $((SECONDS - t0))s; $(grep -c '^step' "$runs/$name.log") log lines"
    grep -E '^disaggregated|dflash: error|Root Cause' "$runs/$name.log" | tail -2
    tail -n 1 "$runs/$name/metrics.jsonl" 2>/dev/null
  } | tee -a "$out/topology.txt"
  { echo "===== $name"; cat "$runs/$name.log"; } >>"$out/topology-logs.txt"
}
run colocated-1 topology.nproc=1
run colocated-2 topology.nproc=2
run disaggregated-1t1d topology.mode=disaggregated 'topology.target_gpus=[0]' 'topology.drafter_gpus=[1]'
# needs 3 GPUs, run only when named: bash tests/distributed/gpu_topology_check.sh CONFIG layer-split-2s1d
run layer-split-2s1d topology.mode=disaggregated 'topology.target_gpus=[0,1]' 'topology.drafter_gpus=[2]' \
  topology.target_stages=2
