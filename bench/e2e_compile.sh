#!/usr/bin/env bash
# End to end, colocated on one GPU: the real trainer eager, with today's compiled drafter, and compiled by
# default (cold kernel cache), then a restart of that run (resumes from its checkpoint, warm kernel cache).
# Run on the GPU machine from the repository root:
#   bash bench/e2e_compile.sh [CONFIG] [RUNS...]
# CONFIG defaults to tests/distributed/configs/gpu-8b.yaml; RUNS to "eager drafter compiled restart":
#   eager     compile.target=false compile.drafter=false  (flex attention and the loss compiled, as before)
#   drafter   compile.target=false                        (the drafter compiled: the previous best)
#   compiled  the defaults (target layers, drafter, flex, loss compiled), kernel cache emptied first
#   restart   `compiled` again on its own output dir: resumes from its last checkpoint, kernel cache warm
# Every log line is prefixed with the unix time it was printed; one JSON line per run goes to
# $OUT/e2e-compile.jsonl: exit code, wall time, the steady tokens/s and sequences/s (records after the
# first, i.e. compilation excluded), peak memory, and the seconds from the target being loaded ("target:"
# line) to the first step line (the restart figure).
. "$(dirname "$0")/lib.sh" /tmp/e2e-compile-out /dev/shm/e2e-compile
config_and_list tests/distributed/configs/gpu-8b.yaml "eager drafter compiled restart" "$@"
which=$list
steps="${STEPS:-20}"
limit="${PER_RUN_LIMIT_S:-240}"
common=(topology.nproc=1 logging.interval=1 eval.speculative_prompts=0 checkpoint.interval="$steps"
        "data.synthetic.num_samples=${SAMPLES:-160}" ${EXTRA_OVERRIDES:-})
for run in $which; do
  case "$run" in
    eager)    dir="$runs/eager";    extra=(compile.target=false compile.drafter=false optim.max_steps="$steps") ;;
    drafter)  dir="$runs/drafter";  extra=(compile.target=false optim.max_steps="$steps") ;;
    compiled) dir="$runs/compiled"; extra=(optim.max_steps="$steps"); rm -rf "$dir" ;;
    restart)  dir="$runs/compiled"; extra=(optim.max_steps="$((steps + 10))") ;;
    *) echo "unknown run '$run'" >&2; exit 2 ;;
  esac
  log="$out/e2e-$run.log"
  t0=$(date +%s.%N)
  timeout -k 15 "$limit" python3 -m dflash train "$cfg" "output_dir=$dir" "${common[@]}" "${extra[@]}" 2>&1 |
    while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done >"$log"
  rc=${PIPESTATUS[0]}
  python3 - "$run" "$rc" "$t0" "$log" "$dir/metrics.jsonl" "$steps" >>"$out/e2e-compile.jsonl" <<'EOF'
import json, sys
run, rc, t0, log, metrics, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
lines = [(float(l.split(" ", 1)[0]), l.split(" ", 1)[1].rstrip("\n")) for l in open(log) if " " in l]
def first(prefix):
    return next((t for t, text in lines if text.startswith(prefix)), None)
try:
    records = [r for x in open(metrics) if x.strip() and (r := json.loads(x)).get("kind") != "eval"]
except OSError:
    records = []
first_step = records[0]["step"] if records else None
this = [r for r in records if r["step"] > (steps if run == "restart" else 0)]
steady = this[2:] if len(this) > 3 else this[1:]  # the first records carry compilation and warm-up
tok = sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None
target_loaded, stepped = first("target:"), first("step ")
print(json.dumps({"run": run, "exit": rc, "wall_s": round(lines[-1][0] - t0, 1) if lines else None,
                  "steps_logged": len(this), "steady_records": len(steady), "tokens_per_s": tok,
                  "sequences_per_s_of_3072": tok / 3072 if tok else None,
                  "peak_mem_gib": max((r.get("mem_gib", 0) for r in this), default=None),
                  "start_to_target_loaded_s": round(target_loaded - t0, 1) if target_loaded else None,
                  "target_loaded_to_first_step_s": round(stepped - target_loaded, 1) if stepped and target_loaded else None,
                  "compile_line": next((text for _, text in lines if text.startswith("compile:")), None),
                  "fallbacks": [text for _, text in lines if "could not be compiled" in text],
                  "last_lines": [text for _, text in lines[-3:]] if rc else None}))
EOF
  tail -n 1 "$out/e2e-compile.jsonl"
done
