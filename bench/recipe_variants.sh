#!/usr/bin/env bash
# One recipe trained under several sets of overrides at once on one GPU machine: which setting moves the loss
# and the real acceptance length. Run from the repository root:
#   bash bench/recipe_variants.sh CONFIG 'LABEL key=value ...' 'LABEL key=value ...' ...
# Each variant is one `dflash train CONFIG output_dir=$RUNS_DIR/LABEL $COMMON <its overrides>`, all started
# together (the GPU and the machine's cores are shared: these runs measure training quality, not speed).
# A variant whose overrides hold `@regen=DIR` starts with DIR's regenerated answers copied into its
# output_dir/regenerated/ (the trainer reuses answers whose cache key matches: answers made elsewhere).
# Per variant: $OUT/var-LABEL.log, $OUT/var-LABEL.jsonl (metrics) and one JSON line in $OUT/variants.jsonl
# (exit, wall time, the loss every 100 steps, the evals).
. "$(dirname "$0")/lib.sh" /tmp/variants-out /dev/shm/variants
cfg="$1"
shift
pids=()
labels=()
for spec in "$@"; do
  read -r label rest <<<"$spec"
  overrides=()
  for word in $rest; do
    case "$word" in
      @regen=*) mkdir -p "$runs/$label/regenerated" && cp "${word#@regen=}"/*.jsonl "$runs/$label/regenerated/" ;;
      *) overrides+=("$word") ;;
    esac
  done
  (
    t0=$SECONDS
    timeout -k 15 "${PER_RUN_LIMIT_S:-300}" python3 -m dflash train "$cfg" "output_dir=$runs/$label" \
      ${COMMON:-} "${overrides[@]}" >"$out/var-$label.log" 2>&1
    echo "$? $((SECONDS - t0))" >"$runs/$label.rc"
  ) &
  pids+=($!)
  labels+=("$label")
done
wait "${pids[@]}"
for label in "${labels[@]}"; do
  cp "$runs/$label/metrics.jsonl" "$out/var-$label.jsonl" 2>/dev/null
  python3 - "$label" "$runs/$label.rc" "$runs/$label/metrics.jsonl" >>"$out/variants.jsonl" <<'EOF'
import json, sys
label, rc_file, metrics = sys.argv[1:4]
rc, wall = (open(rc_file).read().split() + ["?", "?"])[:2]
try:
    records = [json.loads(x) for x in open(metrics) if x.strip()]
except OSError:
    records = []
evals = [{k: r.get(k) for k in ("step", "tau", "tau_walk", "acc", "acceptance_length", "lossless")}
         for r in records if r.get("kind") == "eval"]
train = [r for r in records if r.get("kind") != "eval" and "loss" in r]
print(json.dumps({"label": label, "exit": rc, "wall_s": wall, "evals": evals,
                  "loss": [(r["step"], round(r["loss"], 4)) for r in train if r["step"] % 100 == 0]}))
EOF
  tail -n 1 "$out/variants.jsonl"
done
