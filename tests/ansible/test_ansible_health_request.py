"""One typed health request: HealthRequest (module_utils/dflash_health.py) is the only home of the health check's
options, types and defaults - the module's argument_spec is derived from it, its DOCUMENTATION says the same, the
check fills what it is not given from it - and the job role calls dflash_health in one place
(roles/job/tasks/health.yml), imported by every check of the role with only what differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest
import yaml
from ansible.module_utils.dflash_health import HealthRequest, HealthTracker, Path, check_health
from conftest import ROOT

FIELDS = [f.name for f in dataclasses.fields(HealthRequest)]
ROLE = ROOT / "roles" / "job"


def _library_module():
    loaded = importlib.util.spec_from_file_location("_dflash_library_dflash_health", ROOT / "library" / "dflash_health.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_the_modules_argument_spec_is_the_requests_fields():
    module = _library_module()
    spec = HealthRequest.argument_spec()
    assert module.ARGUMENT_SPEC == spec
    assert list(spec) == FIELDS  # every field is an option, and every option a field
    # the derivation: required, path, list elements, no default for an optional path, choices
    assert spec["name"] == {"type": "str", "required": True}
    assert spec["log_path"] == {"type": "path", "required": True}
    assert spec["state_dir"] == {"type": "path"}
    assert spec["gpu_ids"] == {"type": "list", "elements": "int", "default": []}
    assert spec["nodes"] == {"type": "list", "elements": "str", "default": []}
    assert spec["backend"] == {"type": "str", "default": "auto", "choices": ["auto", "systemd", "daemon"]}
    assert spec["fail_on_unhealthy"] == {"type": "bool", "default": True}
    assert spec["timeout"] == {"type": "int", "default": 300}
    # no option is written by hand in the module: it passes the derived spec
    source = (ROOT / "library" / "dflash_health.py").read_text()
    code = source[source.index('\nRETURN = r"""'):]
    code = code[code.index('"""\n', 20):]
    assert "AnsibleModule(argument_spec=ARGUMENT_SPEC" in code and '"type":' not in code


def test_a_new_field_is_a_new_option():
    """A field added to the request appears in the spec with its type and default (what adding a knob relies on)."""

    @dataclasses.dataclass(frozen=True)
    class Extended(HealthRequest):
        grace: int = 7
        marker: Path | None = None
        tags: list[str] = dataclasses.field(default_factory=lambda: ["a"])
        verbose: bool = dataclasses.field(default=False, metadata={"choices": (False, True)})

    spec = Extended.argument_spec()
    assert list(spec) == FIELDS + ["grace", "marker", "tags", "verbose"]
    assert spec["grace"] == {"type": "int", "default": 7}
    assert spec["marker"] == {"type": "path"}
    assert spec["tags"] == {"type": "list", "elements": "str", "default": ["a"]}
    assert spec["verbose"] == {"type": "bool", "default": False, "choices": [False, True]}
    assert Extended.with_defaults({"name": "j"})["grace"] == 7

    @dataclasses.dataclass(frozen=True)
    class Untyped(HealthRequest):
        when: complex = 0j

    with pytest.raises(TypeError, match="no Ansible option type"):
        Untyped.argument_spec()


def test_the_modules_documentation_lists_the_spec():
    """ansible-doc shows DOCUMENTATION, AnsibleModule checks the spec: the same options, types and defaults."""
    documented = yaml.safe_load(_library_module().DOCUMENTATION)["options"]
    spec = HealthRequest.argument_spec()
    assert sorted(documented) == sorted(spec), sorted(set(documented) ^ set(spec))
    for name, option in spec.items():
        doc = documented[name]
        assert doc.get("description"), name
        facts = {key: doc[key] for key in ("type", "elements", "default", "required", "choices") if key in doc}
        assert facts == option, (name, facts, option)


def test_the_check_takes_its_defaults_from_the_request(tmp_path):
    given = {"name": "job", "log_path": str(tmp_path / "log"), "heartbeat_path": str(tmp_path / "heartbeat.json")}
    tracker = HealthTracker(given)
    assert tracker.window == HealthRequest.defaults()["progress_window"] == 120
    assert tracker.params == {**HealthRequest.defaults(), **given}
    assert HealthRequest.with_defaults({**given, "timeout": 0})["timeout"] == 0  # what is given wins
    source = (ROOT / "module_utils" / "dflash_health.py").read_text()
    # no second default: a field read with a fallback value of its own
    fallbacks = [m for m in re.findall(r'params\.get\("(\w+)", [^)]', source) if m in FIELDS]
    assert not fallbacks, fallbacks
    result = check_health(_NoHost(), {**given, "timeout": 0}, lambda: {"active_state": "inactive", "sub_state": "dead"})
    assert len(result["log_tail"]) == 0 and result["state"] == "stopped"


class _NoHost:
    def now(self):
        return 0.0

    def sleep(self, seconds):
        raise AssertionError("a snapshot does not wait")

    def run(self, args, check_rc=False):
        return 1, "", "no such command"

    def which(self, name, extra_dirs=()):
        return None


def _task_files():
    for top in ("roles", "playbooks"):
        for path in sorted((ROOT / top).rglob("*.yml")):
            if "/molecule/" not in str(path):
                yield path


def _walk(node, found, path):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "dflash_health" or str(key).endswith(".dflash_health"):
                found.append((path, node))
            _walk(value, found, path)
    elif isinstance(node, list):
        for item in node:
            _walk(item, found, path)


def test_the_roles_and_playbooks_call_dflash_health_once():
    calls = []
    for path in _task_files():
        _walk(yaml.safe_load(path.read_text()), calls, path.relative_to(ROOT))
    assert [str(path) for path, _ in calls] == ["roles/job/tasks/health.yml"], calls
    [(_, task)] = calls
    arguments = task["dflash_health"]
    assert set(arguments) <= set(FIELDS), set(arguments) - set(FIELDS)
    assert {"name", "log_path", "heartbeat_path"} <= set(arguments)  # the required ones
    assert arguments["fail_on_unhealthy"] is False  # the callers print the diagnosis once and fail themselves
    assert task["register"] == "_dflash_job_health"


def _imports(path):
    found = []

    def walk(tasks):
        for task in tasks or []:
            if task.get("ansible.builtin.import_tasks") == "health.yml" or task.get("ansible.builtin.include_tasks") == "health.yml":
                found.append(task)
            for key in ("block", "rescue", "always"):
                walk(task.get(key))

    walk(yaml.safe_load(path.read_text()))
    return found


@pytest.mark.parametrize("name, count", [("launch.yml", 3), ("verify.yml", 1), ("status.yml", 1), ("stop.yml", 1)])
def test_every_health_check_of_the_role_imports_the_one_call(name, count):
    """The before-launch snapshot, the start window and the rollback's (launch.yml), verify, status and stop."""
    shared = (ROLE / "tasks" / "health.yml").read_text()
    knobs = set(re.findall(r"\b(_dflash_job_health_\w+)", shared)) - {"_dflash_job_health_async"}
    imports = _imports(ROLE / "tasks" / name)
    assert len(imports) == count, name
    for task in imports:
        chosen = task.get("vars") or {}
        assert chosen.get("_dflash_job_health_task") == task["name"], task["name"]  # the name the output shows
        assert set(chosen) <= knobs, (task["name"], set(chosen) - knobs)  # only what health.yml reads
        assert "register" not in task and "dflash_health" not in task


def test_a_role_health_default_is_not_a_copy_of_the_modules():
    """A role default equal to the module's is a second home for one value: the role leaves it to the module."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    shared = (ROLE / "tasks" / "health.yml").read_text()
    module_defaults = HealthRequest.defaults()
    knobs = [name for name in specs if name.startswith("dflash_job_health_") and name[len("dflash_job_health_"):] in FIELDS]
    assert {"dflash_job_health_timeout", "dflash_job_health_poll_interval", "dflash_job_health_log_lines"} <= set(knobs)
    for knob in knobs:
        field = knob[len("dflash_job_health_"):]
        if knob in defaults:
            assert defaults[knob] != module_defaults[field], f"{knob}: the module's default already; drop it from the role"
        else:
            # no role value: the module's default applies (the argument is left out when the knob is unset)
            [line] = [line for line in shared.splitlines() if line.strip().startswith(f"{field}:")]
            assert knob in line and "default(omit)" in line, line
            assert "default" not in specs[knob], knob
