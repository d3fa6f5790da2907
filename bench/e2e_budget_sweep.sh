#!/usr/bin/env bash
# End-to-end colocated throughput of the real trainer on one GPU for several token budgets.
# Run on the GPU machine from the repository root:
#   bash bench/e2e_budget_sweep.sh [CONFIG] [BUDGETS...]
# CONFIG defaults to the Qwen3-8B-shaped tests/distributed/configs/gpu-8b.yaml, BUDGETS to 6144 12288 24576.
# Each budget is one `dflash train` (25 steps, topology.nproc=1); its last metrics record (tokens/s, drafter
# MFU, input share, peak memory) or its error goes to $OUT/e2e-sweep.jsonl and its log to $OUT/e2e-<budget>.log.
# A budget that runs out of memory ends its run with exit 1 and the CUDA OOM message in its log; the sweep
# goes on. Run outputs stay under $RUNS_DIR (default /dev/shm/e2e-sweep), not in $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/e2e-sweep-out}"
runs="${RUNS_DIR:-/dev/shm/e2e-sweep}"
cfg="${1:-tests/distributed/configs/gpu-8b.yaml}"
shift || true
budgets="${*:-6144 12288 24576}"
limit="${PER_RUN_LIMIT_S:-170}"
mkdir -p "$out" "$runs"
for budget in $budgets; do
  t0=$SECONDS
  timeout -k 15 "$limit" python3 -m dflash train "$cfg" "output_dir=$runs/b$budget" "data.token_budget=$budget" \
    topology.nproc=1 optim.max_steps=25 logging.interval=5 ${EXTRA_OVERRIDES:-} >"$out/e2e-$budget.log" 2>&1
  rc=$?
  last=$(tail -n 1 "$runs/b$budget/metrics.jsonl" 2>/dev/null || true)
  python3 - "$budget" "$rc" "$((SECONDS - t0))" "${last:-null}" >>"$out/e2e-sweep.jsonl" <<'EOF'
import json, sys
budget, rc, wall, last = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
print(json.dumps({"token_budget": budget, "exit": rc, "wall_s": wall, "last": last}))
EOF
  tail -n 1 "$out/e2e-sweep.jsonl"
done
