# The preamble shared by the GPU scripts that run `dflash` from the repository root (bench/*.sh but
# real_recipe.sh, tests/distributed/gpu_topology_check.sh). Source it with the two default folders:
#   . "$(dirname "$0")/lib.sh" OUT_DEFAULT RUNS_DEFAULT
# It sets strict mode (-u, pipefail; not -e: a failed run is recorded and the script goes on), puts the
# repository first on PYTHONPATH, unbuffers Python, and makes $out ($OUT, else OUT_DEFAULT: what comes back)
# and $runs ($RUNS_DIR, else RUNS_DEFAULT: run outputs and checkpoints). The caller's "$@" is left as it was.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-$1}"
runs="${RUNS_DIR:-$2}"
mkdir -p "$out" "$runs"
# config_and_list CONFIG_DEFAULT LIST_DEFAULT "$@": $cfg, the script's first argument (else CONFIG_DEFAULT), and
# $list, the others as one string of words (else LIST_DEFAULT).
config_and_list() {
  local config_default=$1 list_default=$2
  shift 2
  cfg="${1:-$config_default}"
  shift || true
  list="${*:-$list_default}"
}
