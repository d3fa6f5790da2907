#!/usr/bin/env bash
# GPU check of the topologies (not part of pytest): run on a 2-GPU machine from the repository root, e.g.
#   device run, kind nvidia-h200-x2:  bash tests/distributed/gpu_topology_check.sh [CONFIG] [RUNS...]
# Trains CONFIG (default: the Qwen3-8B-shaped gpu-8b.yaml) for STEPS steps (default 20) in each layout and
# ASSERTS, per run: exit 0, the trainer's `done: step STEPS` line, the last metrics record at that step, and
# which rank ran on which host GPU (nvidia-smi's processes while it ran, each with its LOCAL_RANK).
# Runs: colocated-1, colocated-2, disaggregated-1t1d (identity GPU sets), and two non-identity sets:
# visible-1 (CUDA_VISIBLE_DEVICES=1, one rank: host GPU 1 only, GPU 0 untouched) and swapped-1t1d
# (CUDA_VISIBLE_DEVICES=1,0: the target rank on host GPU 1, the drafter rank on host GPU 0); on 3 GPUs also a target split over 2 layer stages (layer-split-2s1d, only
# when named). Exits 1 if any assertion failed.
# Writes $OUT/topology.txt (one PASS/FAIL line per run with its reason, wall time, last metrics record) and
# $OUT/topology-logs.txt (all logs). Run outputs (checkpoints) stay under $RUNS_DIR (default /tmp/gpu-topology).
. "$(dirname "$0")/../../bench/lib.sh" /tmp/gpu-topology-out /tmp/gpu-topology
config_and_list tests/distributed/configs/gpu-8b.yaml "colocated-1 colocated-2 disaggregated-1t1d visible-1 swapped-1t1d" "$@"
wanted=$list
per_run_limit="${PER_RUN_LIMIT_S:-240}"
steps="${STEPS:-20}"
failed=0
python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())' | tee -a "$out/topology.txt"

# every 0.5 s until $1 ends: "HOST_GPU:LOCAL_RANK" of each compute process (LOCAL_RANK from the process's
# environment, '-' for a single process): which rank ran on which host GPU
gpu_sampler() {
  local pid=$1 file=$2
  declare -A index
  while IFS=', ' read -r i uuid; do index[$uuid]=$i; done < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader)
  while kill -0 "$pid" 2>/dev/null; do
    nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader 2>/dev/null | while IFS=', ' read -r uuid p; do
      rank=$({ tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | sed -n 's/^LOCAL_RANK=//p')  # may have ended
      echo "${index[$uuid]:-?}:${rank:--}"
    done >>"$file"
    sleep 0.5
  done
}

# run NAME EXPECTED(sorted HOST_GPU:LOCAL_RANK list) VISIBLE(CUDA_VISIBLE_DEVICES, or - for unset) OVERRIDES...
run() {
  local name=$1 expect=$2 visible=$3; shift 3
  case " $wanted " in *" $name "*) ;; *) return 0 ;; esac
  local log="$runs/$name.log" used="$runs/$name.gpus" t0=$SECONDS
  rm -rf "${runs:?}/$name" "$used"
  touch "$used"
  if [ "$visible" = - ]; then
    timeout -k 15 -s TERM "$per_run_limit" python3 -m dflash train "$cfg" "output_dir=$runs/$name" "optim.max_steps=$steps" \
      "checkpoint.interval=$steps" "logging.interval=5" "$@" >"$log" 2>&1 &
  else
    CUDA_VISIBLE_DEVICES="$visible" timeout -k 15 -s TERM "$per_run_limit" python3 -m dflash train "$cfg" \
      "output_dir=$runs/$name" "optim.max_steps=$steps" "checkpoint.interval=$steps" "logging.interval=5" "$@" >"$log" 2>&1 &
  fi
  local job=$!
  gpu_sampler "$job" "$used" &
  local sampler=$!
  wait "$job"
  local rc=$?
  wait "$sampler"
  local got last reasons=()
  got=$(sort -u "$used" | paste -sd, -)
  last=$(tail -n 1 "$runs/$name/metrics.jsonl" 2>/dev/null)
  [ "$rc" -eq 0 ] || reasons+=("exit $rc (expected 0)")
  grep -q "^done: step $steps\$" "$log" || reasons+=("no 'done: step $steps' line")
  python3 -c 'import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r.get("step")==int(sys.argv[2]) else 1)' \
    "${last:-null}" "$steps" 2>/dev/null || reasons+=("last metrics record is not step $steps: ${last:-none}")
  [ "$got" = "$expect" ] || reasons+=("host GPU:local rank of the job's processes [${got}], expected [${expect}]")
  {
    if [ ${#reasons[@]} -eq 0 ]; then
      echo "PASS $name: exit 0 in $((SECONDS - t0))s, $steps steps, host GPU:local rank [$got]"
    else
      echo "FAIL $name: $(IFS=';'; echo "${reasons[*]}") ($((SECONDS - t0))s)"
      failed=1
    fi
    grep -E '^distributed|dflash: error|Root Cause' "$log" | tail -2
    echo "   $last"
  } | tee -a "$out/topology.txt"
  [ ${#reasons[@]} -eq 0 ] || failed=1
  { echo "===== $name"; cat "$log"; } >>"$out/topology-logs.txt"
}

run colocated-1 0:- - topology.nproc=1
run colocated-2 0:0,1:1 - topology.nproc=2
run disaggregated-1t1d 0:0,1:1 - topology.mode=disaggregated 'topology.target_gpus=[0]' 'topology.drafter_gpus=[1]'
# non-identity: the visible index 0 is host GPU 1; host GPU 0 must stay untouched
run visible-1 1:- 1 topology.nproc=1
# non-identity: visible 0 = host 1 runs local rank 0 (the target), visible 1 = host 0 local rank 1 (the drafter)
run swapped-1t1d 0:1,1:0 1,0 topology.mode=disaggregated 'topology.target_gpus=[0]' 'topology.drafter_gpus=[1]'
# needs 3 GPUs, run only when named: bash tests/distributed/gpu_topology_check.sh CONFIG layer-split-2s1d
run layer-split-2s1d 0:0,1:1,2:2 - topology.mode=disaggregated 'topology.target_gpus=[0,1]' 'topology.drafter_gpus=[2]' \
  topology.target_stages=2
if [ "$failed" -ne 0 ]; then
  echo "gpu_topology_check: FAILED (see $out/topology.txt)" | tee -a "$out/topology.txt"
  exit 1
fi
echo "gpu_topology_check: all runs passed" | tee -a "$out/topology.txt"
