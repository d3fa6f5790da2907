#!/usr/bin/env python3
"""Where `make test`'s CPU time went: the machine's total and each LXC container's share.

scripts/test.sh samples every 15 s into .test-logs/cpu, one line per sample:
    SECONDS TOTAL_CPU_SECONDS NAME=CPU_SECONDS ...
where TOTAL is the machine's busy time (/proc/stat) and NAME=... the CPU time of each running container's
cgroup so far. A container's counter starts again at 0 when it is restarted or re-created: a value below
the previous one is a new life and counts from 0. Prints the totals; what no container used is the host
side (pytest, the ansible controllers, molecule).

    scripts/cpu-report.py .test-logs/cpu
"""

from __future__ import annotations

import sys
from collections import defaultdict


def report(lines: list[str]) -> str:
    first_total = last_total = None
    used: dict[str, float] = defaultdict(float)
    previous: dict[str, float] = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 2:
            continue
        total = float(fields[1])
        first_total = total if first_total is None else first_total
        last_total = total
        for item in fields[2:]:
            name, _, value = item.rpartition("=")
            seconds = float(value)
            before = previous.get(name, 0.0)
            used[name] += seconds - before if seconds >= before else seconds
            previous[name] = seconds
    if first_total is None:
        return "cpu: no samples"
    busy = last_total - first_total
    containers = sum(used.values())
    out = [f"CPU time used while testing: {busy / 60:.1f} core-min; in containers {containers / 60:.1f}, "
           f"on the host (pytest, ansible, molecule) {(busy - containers) / 60:.1f}"]
    for name, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
        out.append(f"  {name:<28} {seconds / 60:6.1f} core-min")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(report(f.read().splitlines()))
