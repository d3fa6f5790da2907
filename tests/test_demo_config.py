"""The demo's contract, pinned without training (issue 30, item 8).

`dflash train configs/tiny-cpu.yaml` is the demo: a bounded run with real-acceptance evals during training,
a few minutes on a 2-core CPU (README, "The trainer alone", with the measured wall time). The long jobs that
deploy the same file (inventories/local's `make train`, the molecule scenarios, the ops fixture) keep their
own length and no periodic evals through their own dflash_job_config, merged over the file the way roles/job
merges it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from dflash.config import RunConfig, _build, load_config, validate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
DEMO_MAX_STEPS = 600  # README's measured wall time is for this length: a longer demo needs a new measurement
LOCAL_GROUP_VARS = ROOT / "inventories" / "local" / "group_vars" / "dflash_containers.yml"


def _combine(base: dict, over: dict) -> dict:
    """ansible.builtin.combine(recursive=True): nested dicts merge, lists and scalars replace."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _combine(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _host_vars(hosts_file: Path, host: str) -> dict:
    """A host's own variables in a YAML inventory (all -> children -> GROUP -> hosts -> HOST)."""
    data = yaml.safe_load(hosts_file.read_text())
    for group in data["all"]["children"].values():
        if host in (group.get("hosts") or {}):
            return group["hosts"][host] or {}
    raise AssertionError(f"{host} is not in {hosts_file}")


def _job_config(*layers: dict) -> dict:
    """The job's dflash_job_config: the most specific layer that sets it replaces the others (Ansible's
    default hash_behaviour), as the molecule scenarios layer host variables over inventories/local's
    group_vars."""
    found = [layer["dflash_job_config"] for layer in layers if "dflash_job_config" in layer]
    assert found, "no layer sets dflash_job_config"
    return found[-1]


def _deployed(job_config: dict) -> RunConfig:
    """The run config roles/job/tasks/configure.yml writes: the base file combined with dflash_job_config."""
    base = yaml.safe_load(TINY.read_text())
    merged = _combine(base, job_config)
    merged["output_dir"] = "/srv/dflash/run"  # forced to dflash_job_run_dir by the role
    config = _build(RunConfig, merged, "")
    validate(config)
    return config


def _role_default_base_config() -> str:
    defaults = yaml.safe_load((ROOT / "roles" / "job" / "defaults" / "main.yml").read_text())
    return defaults["dflash_job_base_config"]


def test_the_demo_is_bounded_and_evaluates_during_training():
    config = load_config(TINY, [])
    steps, every = config.optim.max_steps, config.logging.eval_interval
    assert steps is not None and 0 < steps <= DEMO_MAX_STEPS, f"the demo runs {steps} steps"
    assert 0 < every < steps, f"logging.eval_interval {every}: no eval before the final one at step {steps}"
    assert steps // every >= 2, "fewer than two evals during training"
    # the final eval follows the last step anyway: a periodic one there would decode the same prompts twice
    assert steps % every != 0, f"an eval every {every} steps lands on the last step {steps} as well"
    assert config.eval.speculative_prompts > 0, "the evals must decode for real (the real acceptance length)"
    assert config.runtime.device == "cpu"


def test_make_train_keeps_its_own_length_and_no_periodic_evals():
    group = yaml.safe_load(LOCAL_GROUP_VARS.read_text())
    assert group.get("dflash_job_base_config", _role_default_base_config()) == TINY.name
    config = _deployed(_job_config(group))
    assert config.optim.max_steps == 100000
    assert config.logging.eval_interval == 0
    # siblings survive the merge: the rest of the demo's settings are the job's
    assert config.eval.speculative_prompts == load_config(TINY, []).eval.speculative_prompts
    assert config.logging.interval == group["dflash_job_config"]["logging"]["interval"]


def _vars(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


GROUP = yaml.safe_load(LOCAL_GROUP_VARS.read_text())
LONG_JOBS = {
    # scenario: (its layers of variables over inventories/local's group_vars, its length)
    "molecule/default": ([_host_vars(ROOT / "molecule/default/inventory/hosts.yml", "dflash-mol-default")],
                         100000),
    "molecule/proxmox": ([_host_vars(ROOT / "molecule/proxmox/inventory/hosts.yml", "dflash-mol-pve")],
                         100000),
    "molecule/faults": ([_vars("molecule/faults/inventory/host_vars/dflash-mol-faults.yml")], 100000),
    "molecule/multinode": ([_vars("molecule/multinode/inventory/host_vars/dflash-mol-mn0.yml")], 3000),
    # the default scenario's selfheal phase: play vars and extra vars of its own job
    "molecule/selfheal": ([_vars("molecule/selfheal/vars.yml")], 100000),
}


@pytest.mark.parametrize("name", sorted(LONG_JOBS))
def test_the_molecule_jobs_keep_their_length_and_no_periodic_evals(name):
    layers, steps = LONG_JOBS[name]
    config = _deployed(_job_config(GROUP, *layers))
    assert config.optim.max_steps == steps, f"{name}: {config.optim.max_steps} steps"
    assert config.logging.eval_interval == 0, f"{name}: an eval every {config.logging.eval_interval} steps"
    # these jobs train beside the whole suite on a 2-core machine: a pause after each step, one intra-op thread
    assert config.runtime.step_pause_s >= 0.5 and config.runtime.num_threads == 1, f"{name}: {config.runtime}"


def test_the_ops_fixture_job_keeps_its_length_and_no_periodic_evals():
    group = yaml.safe_load((ROOT / "tests/ops/inventory/group_vars/dflash_containers.yml").read_text())
    config = _deployed(_job_config(group))
    assert config.optim.max_steps == 100000 and config.logging.eval_interval == 0
    assert config.runtime.step_pause_s > 0 and config.runtime.num_threads == 1


def test_the_merge_fails_a_job_that_relies_on_the_demos_length():
    # the check above can fail: a job config that sets no length gets the demo's bounded run and its evals
    config = _deployed({"logging": {"interval": 1}})
    assert config.optim.max_steps != 100000 and config.logging.eval_interval != 0
