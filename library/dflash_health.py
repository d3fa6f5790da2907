#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_health
short_description: Prove that a dflash training job is really training, or say why not
description:
  - Polls until every invariant holds, one fails for good, or O(timeout) passes.
  - C(log) - O(log_path) exists and grows (grew during the check, or is non-empty and was written within
    O(progress_window)).
  - C(unit) - the unit is active and its MainPID is alive.
  - C(gpu) - every GPU in O(gpu_ids) holds at least O(gpu_min_memory_mib) in processes of the unit (MainPID and its
    descendants; memory of other processes does not count). When nvidia-smi lists no process at all (a PID
    namespace that hides them), the GPU's total use is taken.
  - C(progress) - a heartbeat of this launch (its pid is a process of the unit, written after the unit started)
    advances during the check, after a first step. With O(timeout=0) (one snapshot) a heartbeat of this launch in
    status C(training) written within O(progress_window) counts.
  - C(joined) - multi-node jobs (O(node_heartbeat_path) set) - the node file of this launch says every rank of the job
    joined (this node's ranks all finished a step); otherwise the failure names the node that did not join, or the job's
    failure names the node that was lost. On nodes other than 0 the node file is the heartbeat, and the log need only
    exist (node 0's reporter writes the step lines).
  - A heartbeat of an earlier launch is never evidence; the job reads as C(starting) until this launch writes one.
  - A launch whose heartbeat says C(starting) and was rewritten within O(progress_window) (the trainer refreshes it
    while it loads the models and prepares its data) is C(starting), not C(hung), for up to O(start_window) after the
    launch; its log need not grow meanwhile. One that stops refreshing it (frozen, stuck outside Python) is judged by
    O(progress_window) as before.
  - A heartbeat with status C(finished) and a unit that exited 0 count as healthy (RV(finished)).
  - RV(state) names what the job is doing - C(training), C(finished), C(starting), C(hung), C(crashed),
    C(failed-to-start), C(stopped), C(lost) or C(driver-mismatch); RV(ok) is false for C(hung), C(crashed),
    C(failed-to-start), C(lost) and C(driver-mismatch).
  - A dead unit or a missing nvidia-smi ends the wait at once; any other failure that lasts O(progress_window) too.
  - "On failure the message is a diagnosis: the failed invariants and why (for example
    C(no progress: heartbeat step stayed at 12 for 60s), C(unit failed: exit status 2)), the unit state and exit
    status, the heartbeat, the GPU table and the last O(log_lines) log lines, so the trainer's own
    C(dflash: error: ...) line appears in the play output."
  - "A C(hung) job's hang evidence: the check sends SIGUSR1 to the unit's main process when it has a handler for it (a
    trainer with C(dflash/runtime/stacks.py): every rank dumps its threads' stacks to C(RUN_DIR/stacks/rank-R.txt)), waits up
    to 2 s for the files, and reports every rank that dumped during this launch with its main thread's top frames,
    naming the stuck rank(s) (RV(stacks); the diagnosis' C(stacks: rank R (stuck): top frames ...) lines)."
version_added: "0.1.0"
author: dflash authors
options:
  name:
    description: Job (unit) name, as given to M(dflash_unit).
    type: str
    required: true
  backend:
    description: How the job was launched; V(auto) as in M(dflash_unit).
    type: str
    choices: [auto, systemd, daemon]
    default: auto
  state_dir:
    description: The job's state directory, as given to M(dflash_unit). Default C(/var/lib/dflash/units/NAME).
    type: path
  log_path:
    description: The job's log file.
    type: path
    required: true
  heartbeat_path:
    description: The trainer's C(OUTPUT_DIR/heartbeat.json).
    type: path
    required: true
  gpu_ids:
    description: GPU indexes that must hold the model. Empty for CPU jobs.
    type: list
    elements: int
    default: []
  gpu_min_memory_mib:
    description: Minimum used memory per listed GPU.
    type: int
    default: 1024
  timeout:
    description: Seconds to wait for all invariants to hold. V(0) takes one snapshot.
    type: int
    default: 300
  progress_window:
    description: Seconds within which the heartbeat step must advance (and after which any failure is final).
    type: int
    default: 120
  start_window:
    description:
      - Seconds after the launch within which a refreshed C(starting) heartbeat counts as loading, not hung (data
        regeneration of a large data set takes longer than O(progress_window)). Never shorter than
        O(progress_window); V(0) means O(progress_window).
    type: int
    default: 0
  first_failure:
    description:
      - The start window of a launch a deploy can roll back - the first end of this launch is final, also one its
        restart policy restarted (a restart count above 0), so the rollback comes at once, not after the restart burst.
    type: bool
    default: false
  poll_interval:
    description: Seconds between snapshots.
    type: int
    default: 5
  log_lines:
    description: Number of log lines returned and shown in the diagnosis.
    type: int
    default: 40
  fail_on_unhealthy:
    description: Fail the task when the job is not healthy. V(false) reports only (status playbooks).
    type: bool
    default: true
  node_heartbeat_path:
    description: Multi-node jobs - this node's C(OUTPUT_DIR/nodes/node-RANK.json), written by its launcher. Unset for one node.
    type: path
  node_rank:
    description: Multi-node jobs - this node's rank (0 hosts the rendezvous and the reporter).
    type: int
    default: 0
  nodes:
    description: Multi-node jobs - the names of the job's nodes in rank order, for the diagnosis.
    type: list
    elements: str
    default: []
  dump_stacks:
    description:
      - Ask the running job for a stack dump whatever its state (the job role, before a restart requested with
        C(dflash_job_state=restarted)). A C(hung) job is always asked. Only a main process with a handler for SIGUSR1
        is signalled.
    type: bool
    default: false
  world_size:
    description:
      - The job's ranks (all nodes); the stack files of ranks 0 to O(world_size) - 1 are read, no others. V(0) - not
        known - reads ranks 0 to 63.
    type: int
    default: 0
  watchdog:
    description:
      - The unit's watchdog interval (the job role's C(dflash_job_watchdog)), for the diagnosis of a C(hung) job - when
        the watchdog acts (this many seconds after the trainer's last step ping), or that with V(0) (no watchdog) the
        job stays hung until restarted. Changes nothing in the check.
    type: int
    default: 0
attributes:
  check_mode:
    support: full
    description: Only reads (a stack dump, a signal the trainer handles, is asked for in check mode too); runs the same in check mode.
  diff_mode:
    support: none
    description: Changes nothing.
"""

EXAMPLES = r"""
- name: Assert the trainer is training
  dflash_health:
    name: dflash-train
    log_path: /var/log/dflash/dflash-train.log
    heartbeat_path: /var/lib/dflash/runs/dflash-train/heartbeat.json
    gpu_ids: [0, 1, 2, 3, 4, 5, 6, 7]
    gpu_min_memory_mib: 8192
    timeout: 600
    progress_window: 300

- name: Report without failing
  dflash_health:
    name: dflash-train
    log_path: /var/log/dflash/dflash-train.log
    heartbeat_path: /var/lib/dflash/runs/dflash-train/heartbeat.json
    timeout: 0
    fail_on_unhealthy: false
  register: job_health
"""

RETURN = r"""
healthy:
  description: Whether all invariants held (or the job finished cleanly).
  returned: always
  type: bool
state:
  description: >-
    The job's state - training, finished, starting (a launch within its progress window), hung (running, no progress
    for a window), crashed (exited non-zero after steps of this launch), failed-to-start (exited non-zero before its
    first step), stopped (exited 0 without finishing, or never started), lost (meant to run, but the container
    restarted under it and this boot did not launch it again - systemd backend), driver-mismatch (nvidia-smi in the
    container reports a driver/library version mismatch - a driver upgrade on the node - and the job is not
    training; the hint names the provision run that fixes it).
  returned: always
  type: str
ok:
  description: The state is training, finished, starting or stopped (what a status command exits 0 for); not lost.
  returned: always
  type: bool
hint:
  description: What to run for a hung job (the restart command) or a lost one (the relaunch), else null.
  returned: always
  type: str
unit_pids:
  description: MainPID and its live descendants (the processes whose heartbeat and GPU memory count).
  returned: always
  type: list
  elements: int
heartbeat_current:
  description: Whether the heartbeat file was written by this launch.
  returned: always
  type: bool
checkpoint:
  description: Name of the newest checkpoint (C(checkpoints/latest)), or null.
  returned: always
  type: str
checkpoint_step:
  description: Step of the newest checkpoint, or null.
  returned: always
  type: int
finished:
  description: The heartbeat says C(finished) and the unit exited 0.
  returned: always
  type: bool
failed_invariants:
  description: Names of the failed invariants (log, unit, gpu, progress).
  returned: always
  type: list
  elements: str
failures:
  description: The failed invariants with their reasons.
  returned: always
  type: list
  elements: dict
diagnosis:
  description: Human-readable report (also the failure message).
  returned: success (on failure it is RV(msg))
  type: str
unit:
  description: The unit's state (backend, active_state, sub_state, main_pid, main_pid_alive, exit_status, result).
  returned: always
  type: dict
failure_class:
  description:
    - The class of the job's last failure (docs/operations.md, "Self-healing") - C(bad_input), C(data_error),
      C(cuda_oom), C(collective_timeout), C(gpu_error), C(signal) or C(unknown) - from the trainer's C(failed)
      heartbeat, else from the unit's exit status; null when it did not fail.
  returned: always
  type: str
  sample: cuda_oom
step:
  description: Heartbeat step (of this launch only; null before its first heartbeat).
  returned: always
  type: int
epoch:
  description: Heartbeat epoch.
  returned: always
  type: int
loss:
  description: Heartbeat loss.
  returned: always
  type: float
tokens_per_s:
  description: Heartbeat throughput, only while the state is training or finished.
  returned: always
  type: float
tau:
  description: Heartbeat simulated acceptance length (on the training data).
  returned: always
  type: float
eval_tau:
  description: Simulated acceptance length on the held-out data at the last eval, or null before one.
  returned: always
  type: float
acceptance_length:
  description: Real acceptance length (greedy speculative decoding with the target) at the last eval, or null.
  returned: always
  type: float
node:
  description: Multi-node jobs - this launch's node file (status, all_joined, step, missing, error, lost_node), or null.
  returned: always
  type: dict
all_joined:
  description: Multi-node jobs - whether every rank of the job joined; null for one node.
  returned: always
  type: bool
lost_node:
  description: Multi-node jobs - the name of the node the failed job lost first (this node when its ranks failed first), or null.
  returned: always
  type: str
heartbeat:
  description: The whole heartbeat document, or null.
  returned: success
  type: dict
gpus:
  description: GPU facts as in M(dflash_gpu_facts) (only when O(gpu_ids) is set).
  returned: success
  type: list
  elements: dict
gpu_table:
  description: The GPUs as a table, or null (on failure, inside RV(msg)).
  returned: success
  type: str
log_tail:
  description:
    - The last O(log_lines) lines of the log (on failure, inside RV(msg)), the line being written included; a
      progress bar redrawn with carriage returns shows its last state, as in M(dflash_logs) (one reader).
  returned: success
  type: list
  elements: str
stacks:
  description:
    - A hung job's stacks dumped during this launch, one per rank (empty otherwise) - C(rank), C(stuck) (the rule
      of module_utils/dflash_stacks.py - the rank(s) whose main thread's top frame is not where the others wait),
      C(frames) (the top 3, C(function (file:line))), C(dumped_at) (unix time), C(fatal) (C(Aborted) for the
      watchdog's SIGABRT, else null) and C(path).
  returned: success
  type: list
  elements: dict
elapsed_s:
  description: Seconds the check took.
  returned: always
  type: float
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_health import HealthRequest, check_health
from ansible.module_utils.dflash_host import ModuleHost
from ansible.module_utils.dflash_unit import get_backend, resolve_backend
from ansible.module_utils.dflash_unit_spec import UnitError, default_state_dir, unit_name

# The options, their types and defaults are the fields of HealthRequest (module_utils/dflash_health.py): their one
# home. DOCUMENTATION above says the same (tests/ansible/test_ansible_health_request.py checks it).
ARGUMENT_SPEC = HealthRequest.argument_spec()


def launch_started_at(host, backend_name, params):
    """Wall-clock start of the unit's current or last launch (systemd keeps it for failed units too), or None."""
    if backend_name != "systemd":
        return None
    rc, out, _err = host.run(["systemctl", "show", unit_name(params["name"]), "--property=ExecMainStartTimestampMonotonic"])
    value = out.strip().partition("=")[2] if rc == 0 else ""
    if not value.isdigit() or int(value) == 0:
        return None
    return time.time() - (time.monotonic() - int(value) / 1e6)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = dict(module.params)
    params["state_dir"] = params["state_dir"] or default_state_dir(params["name"])
    host = ModuleHost(module)
    try:
        backend = get_backend(resolve_backend(params["backend"]), host)
        spec = {"name": params["name"], "state_dir": params["state_dir"]}

        def status_probe():
            status = backend.status(spec)
            status["backend"] = backend.name
            status["started_at"] = launch_started_at(host, backend.name, params)
            return status

        result = check_health(host, params, status_probe)
    except UnitError as exc:
        module.fail_json(msg=str(exc))
    if not result["healthy"] and params["fail_on_unhealthy"]:
        # The diagnosis already holds the log tail and GPU table: keep the failure output readable.
        brief = {k: v for k, v in result.items()
                 if k not in ("diagnosis", "failures", "log_tail", "gpu_table", "gpus", "gpu_processes", "heartbeat", "node")}
        module.fail_json(msg=result["diagnosis"], **brief)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
