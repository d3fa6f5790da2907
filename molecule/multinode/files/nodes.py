"""Probe and break the two-node job from the LXC host (both containers share its clock), with no playbook.

    python3 nodes.py sockets CONTAINER UNIT
        the TCP connections of every process of UNIT in CONTAINER: their addresses, those not on loopback
    python3 nodes.py kill LOST SURVIVOR UNIT RUN_DIR
        SIGKILL every process of UNIT in LOST, then time until SURVIVOR's UNIT is no longer active
    python3 nodes.py reference CONTAINER UNTIL OUTPUT_DIR PYTHON CONFIG [OVERRIDES...]
        one process with the same config trained up to step UNTIL, in CONTAINER
    python3 nodes.py losses RUN_DIR REFERENCE_DIR
        every step of RUN_DIR/metrics.jsonl (resumed steps included) against the one-process reference

Each prints one JSON object.
"""

import json
import re
import subprocess
import sys
import time

POLL = 0.1

# Runs inside the container: MainPID's process tree, its sockets' inodes, and /proc/net/tcp{,6}.
SOCKETS = r"""
import json, os, sys
main = int(sys.argv[1])
kids = {}
for p in filter(str.isdigit, os.listdir('/proc')):
    try:
        ppid = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])
    except OSError:
        continue
    kids.setdefault(ppid, []).append(int(p))
tree, todo = set(), [main]
while todo:
    p = todo.pop()
    if p not in tree:
        tree.add(p)
        todo += kids.get(p, [])
inodes = set()
for p in tree:
    try:
        for fd in os.listdir(f'/proc/{p}/fd'):
            target = os.readlink(f'/proc/{p}/fd/{fd}')
            if target.startswith('socket:['):
                inodes.add(target[8:-1])
    except OSError:
        pass

def addr(hexaddr):
    ip, port = hexaddr.split(':')
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return '.'.join(str(b) for b in raw[::-1]) + ':' + str(int(port, 16))
    words = [raw[i:i + 4][::-1].hex() for i in range(0, 16, 4)]
    return '[' + ':'.join(w[j:j + 4] for w in words for j in (0, 4)) + ']:' + str(int(port, 16))

found = []
for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[9] in inodes:
            found.append((addr(f[1]), addr(f[2])))
print(json.dumps({'pids': len(tree), 'sockets': found}))
"""


def attach(container, *argv, check=True):
    return subprocess.run(["lxc-attach", "-n", container, "--clear-env", "--", *argv], capture_output=True, text=True,
                          check=check).stdout


def show(container, unit):
    out = attach(container, "systemctl", "show", unit, "-p", "ActiveState,SubState,MainPID,ExecMainStatus")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


LOOPBACK = ("127.0.0.1", "[0000:0000:0000:0000:0000:0000:0000:0001]", "[0000:0000:0000:0000:0000:ffff:7f00:0001]")


def sockets(container, unit):
    """Connections (both ends) and listeners (the stores bind every address; what connects to them is what counts)."""
    main = show(container, unit)["MainPID"]
    data = json.loads(attach(container, "python3", "-c", SOCKETS, main))
    connected = [pair for pair in data["sockets"] if not pair[1].endswith(":0")]
    hosts = sorted({re.sub(r":\d+$", "", end) for pair in connected for end in pair})
    return {"addresses": hosts, "connections": len(connected), "listeners": len(data["sockets"]) - len(connected),
            "not_loopback": [h for h in hosts if h not in LOOPBACK], "processes": data["pids"]}


# Runs inside the container: train until the metrics reach a step, then SIGTERM (the trainer stops after that step).
REFERENCE = r"""
import json, os, signal, subprocess, sys, time
until, metrics, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
proc = subprocess.Popen(cmd)
def reached():
    try:
        with open(metrics) as handle:
            return any(json.loads(line).get('step', 0) >= until for line in handle if line.strip())
    except (OSError, ValueError):
        return False
while proc.poll() is None and not reached():
    time.sleep(0.2)
if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
sys.exit(proc.wait())
"""


def reference(container, until, output_dir, python, config, *overrides):
    """One process, the same config, trained up to step UNTIL (its schedule is the whole run's)."""
    t0 = time.monotonic()
    cmd = [python, "-m", "dflash", "train", config, f"output_dir={output_dir}", *overrides]
    done = subprocess.run(["lxc-attach", "-n", container, "--clear-env", "--set-var", "PYTHONPATH=/opt/dflash/current",
                           "--", "python3", "-c", REFERENCE, until, f"{output_dir}/metrics.jsonl", *cmd],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"nodes.py: the reference run failed (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {"seconds": round(time.monotonic() - t0, 1), "last_line": done.stdout.strip().splitlines()[-1]}


def read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def kill(lost, survivor, unit, run_dir):
    before = read_json(f"{run_dir}/heartbeat.json")
    t0 = time.monotonic()
    attach(lost, "systemctl", "kill", "--signal=SIGKILL", unit)
    deadline = t0 + 300
    while time.monotonic() < deadline:
        state = show(survivor, unit)
        if state["ActiveState"] not in ("active", "activating", "deactivating"):
            break
        time.sleep(POLL)
    else:
        sys.exit(f"nodes.py: {survivor}'s {unit} still {state['ActiveState']} 300 s after the kill")
    ended = round(time.monotonic() - t0, 1)
    with open(f"{run_dir}/checkpoints/latest") as handle:  # read once nothing can write one any more
        checkpoint = int(re.search(r"(\d+)\s*$", handle.read()).group(1))
    return {"survivor_ended_s": ended, "survivor": state, "lost": show(lost, unit),
            "step_at_fault": before.get("step"), "checkpoint_at_fault": checkpoint}


def losses(run_dir, reference_dir):
    def records(path):
        with open(path) as handle:
            return [r for r in map(json.loads, handle) if "loss" in r and r.get("kind") != "eval"]

    reference = {r["step"]: r["loss"] for r in records(f"{reference_dir}/metrics.jsonl")}
    run = records(f"{run_dir}/metrics.jsonl")
    worst, where, missing = 0.0, None, []
    for r in run:
        if r["step"] not in reference:
            missing.append(r["step"])
            continue
        rel = abs(r["loss"] - reference[r["step"]]) / max(abs(reference[r["step"]]), 1e-12)
        if rel >= worst:
            worst, where = rel, r["step"]
    steps = [r["step"] for r in run]
    return {"records": len(run), "distinct_steps": len(set(steps)), "repeated_steps": len(steps) - len(set(steps)),
            "last_step": max(steps, default=0), "reference_steps": len(reference), "missing_in_reference": missing[:10],
            "max_rel_diff": worst, "at_step": where}


if __name__ == "__main__":
    action, args = sys.argv[1], sys.argv[2:]
    result = {"sockets": sockets, "kill": kill, "losses": losses, "reference": reference}[action](*args)
    print(json.dumps(result))
