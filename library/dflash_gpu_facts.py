#!/usr/bin/python
# Copyright: dflash authors
# Apache-2.0

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_gpu_facts
short_description: Gather NVIDIA GPU and GPU process facts from nvidia-smi
description:
  - Runs C(nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,memory.used,utilization.gpu,mig.mode.current
    --format=csv,noheader,nounits) and C(nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory ...)
    and returns them as facts.
  - Values that nvidia-smi reports as C([N/A]) or C([Not Supported]) (MIG mode, virtual GPUs) become C(null).
  - Fails with a message that names the fix when nvidia-smi is missing, cannot reach the driver, or reports a
    C(Driver/library version mismatch) (unless O(required=false)).
version_added: "0.1.0"
author: dflash authors
options:
  required:
    description:
      - When V(true), a missing or failing nvidia-smi fails the task.
      - When V(false), the task succeeds with empty facts, C(dflash_gpu_available=false) and the error in
        C(dflash_gpu_error) (CPU-only hosts).
    type: bool
    default: true
  nvidia_smi:
    description:
      - Path of the nvidia-smi binary. Looked up in C(PATH) and the usual system directories when omitted.
    type: path
  health:
    description:
      - Also read each GPU's health from C(nvidia-smi -q) (uncorrectable ECC errors since the driver loaded, a failed
        or pending row remap, a pending page retirement, a GPU that is lost) and the kernel's fatal Xid records
        (C(dmesg), where this host may read it), into C(dflash_gpu_faults) and C(dflash_gpu_lost).
    type: bool
    default: false
  kernel_log:
    description:
      - With O(health), the kernel's log as the node read it (its C(NVRM) Xid lines are enough), for a container that
        may not read C(dmesg) (an unprivileged one); the Xids of this container's GPUs are found by bus id.
      - Omitted, C(dmesg) is read here where it may be.
    type: str
attributes:
  check_mode:
    support: full
    description: Only reads; runs the same in check mode.
  diff_mode:
    support: none
    description: Changes nothing, so there is nothing to diff.
  facts:
    support: full
"""

EXAMPLES = r"""
- name: Read the GPUs of the container
  dflash_gpu_facts:

- name: Read GPUs where there may be none
  dflash_gpu_facts:
    required: false

- name: Refuse GPU ids the node does not have
  ansible.builtin.assert:
    that: item in (ansible_facts.dflash_gpus | map(attribute='index'))
    fail_msg: "GPU {{ item }} does not exist on {{ inventory_hostname }}"
  loop: [0, 1, 2]
"""

RETURN = r"""
ansible_facts:
  description: The facts.
  returned: always
  type: complex
  contains:
    dflash_gpus:
      description: One entry per physical GPU.
      type: list
      elements: dict
      sample:
        - index: 0
          uuid: GPU-c759e63c-29f0-7cc5-2732-e587923e50c9
          name: NVIDIA H200
          driver_version: 580.159.04
          memory_total_mib: 143771
          memory_used_mib: 0
          utilization_pct: 0
          mig_mode: Disabled
          mig_enabled: false
    dflash_gpu_processes:
      description: Compute processes; C(gpu_index) is null for a UUID that is not a listed GPU (e.g. a MIG instance).
      type: list
      elements: dict
      sample:
        - gpu_uuid: GPU-c759e63c-29f0-7cc5-2732-e587923e50c9
          gpu_index: 0
          pid: 429
          process_name: python3
          used_memory_mib: 2426
    dflash_gpu_available:
      description: Whether nvidia-smi answered.
      type: bool
    dflash_gpu_driver_version:
      description: The driver version of the first GPU, or null.
      type: str
    dflash_gpu_error:
      description: Why nvidia-smi did not answer (only with O(required=false)), else null.
      type: str
    dflash_gpu_faults:
      description: With O(health), GPU index -> what makes it unfit (each with its fix); empty when all are fit.
      type: dict
    dflash_gpu_lost:
      description: With O(health), the GPUs nvidia-smi could not reach (bus id and why).
      type: list
      elements: str
gpu_table:
  description: The GPUs as a human-readable table.
  returned: when GPUs were read
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.dflash_gpu import GpuQueryError, format_gpu_table, gpu_faults, query_gpus
from ansible.module_utils.dflash_host import ModuleHost


def main():
    module = AnsibleModule(
        argument_spec={
            "required": {"type": "bool", "default": True},
            "nvidia_smi": {"type": "path"},
            "health": {"type": "bool", "default": False},
            "kernel_log": {"type": "str"},
        },
        supports_check_mode=True,
    )
    host = ModuleHost(module)
    facts = {
        "dflash_gpus": [],
        "dflash_gpu_processes": [],
        "dflash_gpu_available": False,
        "dflash_gpu_driver_version": None,
        "dflash_gpu_error": None,
        "dflash_gpu_faults": {},
        "dflash_gpu_lost": [],
    }
    try:
        gpus, processes = query_gpus(host, nvidia_smi=module.params["nvidia_smi"])
    except GpuQueryError as exc:
        if module.params["required"]:
            module.fail_json(msg=str(exc), error_kind=exc.kind)
        facts["dflash_gpu_error"] = str(exc)
        module.exit_json(changed=False, ansible_facts=facts, error_kind=exc.kind)
    if module.params["health"]:
        faults, lost = gpu_faults(host, gpus, nvidia_smi=module.params["nvidia_smi"],
                                  kernel_log=module.params["kernel_log"])
        facts.update(dflash_gpu_faults={str(i): found for i, found in faults.items()}, dflash_gpu_lost=lost)
    facts.update(
        dflash_gpus=gpus,
        dflash_gpu_processes=processes,
        dflash_gpu_available=True,
        dflash_gpu_driver_version=gpus[0]["driver_version"] if gpus else None,
    )
    module.exit_json(changed=False, ansible_facts=facts, gpu_table=format_gpu_table(gpus, processes))


if __name__ == "__main__":
    main()
