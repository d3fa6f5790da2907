#!/usr/bin/env bash
# Print the failed tasks of a molecule log again, at its end: the part of a long run that a reader of
# only its last lines needs (which task failed, on which host, with which message). Failures that a
# playbook ignores on purpose ("...ignoring") and those quoted inside a task's output are left out.
#   scripts/show-failures.sh LOG
set -uo pipefail
log=${1:?usage: show-failures.sh LOG}
python3 - "$log" <<'PY'
import re
import sys

lines = [re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip("\n")) for line in open(sys.argv[1], errors="replace")]
top = re.compile(r"^\s*(│ )?(fatal|failed): \[")  # a task's own result, not one quoted in its output
print(f"\n=== failed tasks in {sys.argv[1]} ===")
shown = 0
for i, line in enumerate(lines):
    if not top.match(line):
        continue
    after = lines[i + 1:i + 40]
    end = next((j for j, text in enumerate(after) if "TASK [" in text), len(after))
    if any("...ignoring" in text for text in after[:end]):
        continue
    start = max(0, i - 12)
    print(f"--- line {i + 1} ---")
    print("\n".join(lines[start:i + 1 + end]))
    shown += 1
    if shown == 5:
        break
if not shown:
    print("(none found: see the recap above)")
print("=== end of the failed tasks ===")
PY
