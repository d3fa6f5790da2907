#!/usr/bin/env bash
# The body of `make test`: ruff, then pytest beside the molecule scenarios (real LXC containers),
# each phase logged to .test-logs/PHASE.log. At the end: the phase times, the machine's load while
# they ran, and, for a failed phase, its failed tasks (molecule) or its last lines (the rest).
#
# Settings (environment):
#   DFLASH_TEST_SCENARIOS  molecule scenarios, longest first (default: every scenario, see below)
#   DFLASH_TEST_PARALLEL   molecule scenarios run side by side (default 3: much of their time is waiting)
#   DFLASH_TEST_PYTEST     1: pytest beside molecule (default); 0: before it
#   PYTEST_ARGS            extra pytest arguments (e.g. -k ..., -m "not slow")
#
#   scripts/test.sh                 everything
#   scripts/test.sh molecule        the molecule scenarios only (same pool, same report)
#   scripts/test.sh scenario NAME   one molecule scenario (used by the pool; logs to .test-logs/molecule-NAME.log)
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
LOGS=.test-logs
export PATH="$PWD/$VENV/bin:$PATH" ANSIBLE_CONFIG="$PWD/ansible.cfg"

scenario() {
  local name=$1
  molecule test -s "$name" > "$LOGS/molecule-$name.log" 2>&1
}

if [[ "${1:-}" == scenario ]]; then
  scenario "$2"
  exit
fi
ONLY=${1:-all}

# Longest first, so that the pool ends together.
SCENARIOS=${DFLASH_TEST_SCENARIOS:-faults default multinode proxmox}
PARALLEL=${DFLASH_TEST_PARALLEL:-3}
BESIDE=${DFLASH_TEST_PYTEST:-1}

rm -rf "$LOGS"
mkdir -p "$LOGS"
start=$(date +%s)

# Record a phase: NAME START END RC, one line each.
# The phase's CPU time (its processes and their children; not the containers') goes to
# .test-logs/PHASE.cpu: bash's `times` (not in a pipeline: a pipeline's element has no children).
phase() {
  local name=$1 begin rc
  shift
  begin=$(date +%s)
  ( "$@"; rc=$?; times > "$LOGS/$name.cpu"; exit $rc )
  rc=$?
  echo "$name $begin $(date +%s) $rc" >> "$LOGS/times"
  return $rc
}

# Minutes of CPU in a PHASE.cpu file (bash's `times`: its last line is the children's "0m12.500s 0m1.250s"), or "-".
cpu_minutes() {
  [[ -s "$1" ]] || { echo -; return; }
  tail -n 1 "$1" | tr -d 's' | awk '{ split($1, u, "m"); split($2, k, "m"); printf "%.1f", u[1] + u[2] / 60 + k[1] + k[2] / 60 }'
}

# Every 15 s while the tests run: the load average, and the CPU time used so far by the machine and by
# each LXC container (cgroup v1 or v2), for scripts/cpu-report.py. A phase's "CPU (min)" in the table at
# the end counts its own processes (pytest and its workers; molecule and its ansible runs), not the
# containers' (the report after the table has those).
cpu_sample() {
  local line f name
  line="$(date +%s) $(awk '/^cpu /{ printf "%.2f", ($2 + $3 + $4 + $7 + $8 + $9) / 100 }' /proc/stat)"
  for f in /sys/fs/cgroup/cpuacct/lxc.payload.*/cpuacct.usage; do
    [[ -r "$f" ]] || continue
    name=${f%/cpuacct.usage}; name=${name##*/lxc.payload.}
    line+=" $name=$(awk '{ printf "%.2f", $1 / 1e9 }' "$f")"
  done
  for f in /sys/fs/cgroup/lxc.payload.*/cpu.stat; do
    [[ -r "$f" ]] || continue
    name=${f%/cpu.stat}; name=${name##*/lxc.payload.}
    line+=" $name=$(awk '$1 == "usage_usec" { printf "%.2f", $2 / 1e6 }' "$f")"
  done
  echo "$line" >> "$LOGS/cpu"
}
cpu_sample
( while sleep 15; do cut -d' ' -f1 /proc/loadavg >> "$LOGS/load"; cpu_sample; done ) &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT

[[ "$ONLY" == all ]] && phase lint ruff check dflash tests bench library module_utils connection_plugins doc_fragments playbooks/action_plugins playbooks/strategy_plugins > "$LOGS/lint.log" 2>&1
[[ -f "$LOGS/lint.log" ]] && cat "$LOGS/lint.log"

# -n 2: one worker per core; tests that spawn several processes are grouped (xdist_group) per worker.
# Each test's CPU seconds (tests/conftest.py) go to .test-logs/pytest-cpu.tsv: the costliest are listed at the end.
export DFLASH_TEST_CPU_LOG="$PWD/$LOGS/pytest-cpu.tsv"
run_pytest() { phase pytest pytest -q -n 2 --dist loadgroup --durations=25 -p no:cacheprovider ${PYTEST_ARGS:-} > "$LOGS/pytest.log" 2>&1; }
run_molecule() {
  # One `molecule test` per scenario, PARALLEL at a time; each scenario's phase line is written by the pool.
  printf '%s\n' $SCENARIOS | xargs -P "$PARALLEL" -I{} bash -c \
    'b=$(date +%s); "$0" scenario {}; r=$?; times > '"$LOGS"'/molecule-{}.cpu; echo "molecule-{} $b $(date +%s) $r" >> '"$LOGS"'/times; exit 0' "$0"
}

echo "test: pytest and the molecule scenarios ($SCENARIOS, $PARALLEL side by side) run now; logs in $LOGS/"
if [[ "$ONLY" == molecule ]]; then
  run_molecule
elif [[ "$BESIDE" == 1 ]]; then
  run_pytest &
  pytest_pid=$!
  run_molecule
  wait "$pytest_pid"
else
  run_pytest
  run_molecule
fi
end=$(date +%s)
kill $sampler 2>/dev/null
cpu_sample

echo
[[ -f "$LOGS/pytest.log" ]] && tail -n 40 "$LOGS/pytest.log"
failed=0
while read -r name begin finish rc; do
  if [[ "$rc" != 0 ]]; then
    failed=1
    echo
    echo "=== $name FAILED (exit $rc): $LOGS/$name.log ==="
    if [[ "$name" == molecule-* ]]; then
      grep -E '^(PLAY RECAP|.*: ok=[0-9]+ +changed=)' "$LOGS/$name.log" | tail -n 6
      scripts/show-failures.sh "$LOGS/$name.log"
    else
      tail -n 60 "$LOGS/$name.log"
    fi
  fi
done < "$LOGS/times"

echo
echo "=== make test: phase times ($(nproc) cores) ==="
printf '%-22s %9s %9s %6s %13s\n' phase "start (s)" "took (s)" exit "CPU (min)"
sort -k2,2n "$LOGS/times" | while read -r name begin finish rc; do
  printf '%-22s %9d %9d %6s %13s\n' "$name" $((begin - start)) $((finish - begin)) "$rc" "$(cpu_minutes "$LOGS/$name.cpu")"
done
printf '%-22s %9s %9d\n' total "" $((end - start))
if [[ -s "$LOGS/load" ]]; then
  awk '{ s += $1; if ($1 > m) m = $1 } END { printf "load average while testing: mean %.1f, max %.1f (%d samples, every 15 s)\n", s / NR, m, NR }' "$LOGS/load"
fi
[[ -s "$LOGS/cpu" ]] && python3 scripts/cpu-report.py "$LOGS/cpu"
if [[ -s "$DFLASH_TEST_CPU_LOG" ]]; then
  awk -F'\t' '{ s += $1 } END { printf "pytest: %.1f CPU-min in %d tests; the costliest (CPU s, wall s):\n", s / 60, NR }' "$DFLASH_TEST_CPU_LOG"
  sort -t$'\t' -k1,1 -rn "$DFLASH_TEST_CPU_LOG" | head -n 15 | awk -F'\t' '{ printf "  %7.1f %7.1f  %s\n", $1, $2, $3 }'
fi
exit $failed
