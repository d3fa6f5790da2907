#!/usr/bin/env bash
# float8 against bf16 on the real acceptance length: one recipe trained both ways from one seed on the GPU.
# Run on the GPU machine from the repository root (torchao importable; docs/PERFORMANCE.md):
#   bash bench/float8_acceptance.sh [CONFIG] [key=value ...]
# CONFIG defaults to the demo recipe configs/tiny-cpu.yaml (random-weight target, regenerated answers, real
# speculative decoding at its evals), run on CUDA. Each variant is one `dflash train` with the same seed, data
# and evals; `drafter.float8=true` is the only difference. Its metrics.jsonl (the loss curve, the eval records
# with the real acceptance length) goes to $OUT/f8acc-<variant>.jsonl, its log to $OUT/f8acc-<variant>.log, and
# one JSON line per variant (exit, wall time, the evals) to $OUT/f8acc.jsonl.
. "$(dirname "$0")/lib.sh" /tmp/f8acc-out /dev/shm/f8acc
cfg="${1:-configs/tiny-cpu.yaml}"
shift || true
for variant in ${VARIANTS:-bf16 fp8}; do
  extra=()
  [ "$variant" = fp8 ] && extra=(drafter.float8=true)
  t0=$SECONDS
  timeout -k 15 "${PER_RUN_LIMIT_S:-300}" python3 -m dflash train "$cfg" "output_dir=$runs/${LABEL:-}$variant" \
    runtime.device=cuda "$@" "${extra[@]}" >"$out/f8acc-${LABEL:-}$variant.log" 2>&1
  rc=$?
  cp "$runs/${LABEL:-}$variant/metrics.jsonl" "$out/f8acc-${LABEL:-}$variant.jsonl" 2>/dev/null
  python3 - "$variant" "$rc" "$((SECONDS - t0))" "$runs/${LABEL:-}$variant/metrics.jsonl" "${LABEL:-}" >>"$out/f8acc.jsonl" <<'EOF'
import json, sys
variant, rc, wall, metrics, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
try:
    records = [json.loads(x) for x in open(metrics) if x.strip()]
except OSError:
    records = []
evals = [{k: r.get(k) for k in ("step", "tau", "tau_walk", "acceptance_length", "lossless")}
         for r in records if r.get("kind") == "eval"]
train = [r for r in records if r.get("kind") != "eval"]
print(json.dumps({"label": label, "variant": variant, "exit": rc, "wall_s": wall, "evals": evals,
                  "loss": [(r["step"], round(r["loss"], 4)) for r in train],
                  "tokens_per_s": train[-1].get("tokens_per_s") if train else None}))
EOF
  tail -n 1 "$out/f8acc.jsonl"
done
