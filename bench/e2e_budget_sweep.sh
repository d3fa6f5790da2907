#!/usr/bin/env bash
# End-to-end colocated throughput of the real trainer on one GPU for several token budgets.
# Run on the GPU machine from the repository root:
#   bash bench/e2e_budget_sweep.sh [CONFIG] [BUDGETS...]
# CONFIG defaults to the Qwen3-8B-shaped tests/distributed/configs/gpu-8b.yaml, BUDGETS to 6144 12288 24576.
# Each budget is one `dflash train` (25 steps, topology.nproc=1); its last metrics record (tokens/s, drafter
# MFU, input share, peak memory) or its error goes to $OUT/e2e-sweep.jsonl and its log to $OUT/e2e-<budget>.log;
# `nvidia-smi` samples GPU 0 once a second during each run, and the line gets the mean utilization over the
# samples taken after the first logged step (steady training, model load and compilation excluded).
# A budget that runs out of memory ends its run with exit 1 and the CUDA OOM message in its log; the sweep
# goes on. Run outputs stay under $RUNS_DIR (default /dev/shm/e2e-sweep), not in $OUT. LABEL (default none)
# prefixes the run names and is recorded in each line, so one call can sweep several settings
# (EXTRA_OVERRIDES: more `dflash train` overrides, e.g. the data).
. "$(dirname "$0")/lib.sh" /tmp/e2e-sweep-out /dev/shm/e2e-sweep
config_and_list tests/distributed/configs/gpu-8b.yaml "6144 12288 24576" "$@"
budgets=$list
limit="${PER_RUN_LIMIT_S:-170}"
label="${LABEL:-}"
for budget in $budgets; do
  t0=$SECONDS
  smi="$out/e2e-$label$budget-smi.csv"
  nvidia-smi -i 0 --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 >"$smi" 2>/dev/null &
  smi_pid=$!
  timeout -k 15 "$limit" python3 -m dflash train "$cfg" "output_dir=$runs/$label$budget" "data.token_budget=$budget" \
    topology.nproc=1 optim.max_steps="${STEPS:-25}" logging.interval=5 ${EXTRA_OVERRIDES:-} >"$out/e2e-$label$budget.log" 2>&1
  rc=$?
  kill "$smi_pid" 2>/dev/null; wait "$smi_pid" 2>/dev/null
  python3 - "$budget" "$rc" "$((SECONDS - t0))" "$runs/$label$budget/metrics.jsonl" "$smi" "$label" >>"$out/e2e-sweep.jsonl" <<'EOF'
import datetime, json, sys
budget, rc, wall, metrics, smi, label = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
try:
    records = [r for x in open(metrics) if x.strip() and (r := json.loads(x)).get("kind") != "eval"]
except OSError:
    records = []
util = None
if records:
    first_logged = records[0]["time"]
    samples = []
    for row in open(smi):
        parts = [p.strip() for p in row.split(",")]
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, float(parts[1])))
        except (ValueError, IndexError):
            continue
    # nvidia-smi prints local time; the metrics' time is a unix timestamp: both read on this machine
    steady = [u for t, u in samples if t >= first_logged and t <= records[-1]["time"]]
    util = sum(steady) / len(steady) if steady else None
print(json.dumps({"label": label, "token_budget": budget, "exit": rc, "wall_s": wall, "gpu_util_pct": util,
                  "gpu_util_samples": len(steady) if records else 0, "last": records[-1] if records else None}))
EOF
  tail -n 1 "$out/e2e-sweep.jsonl"
done
