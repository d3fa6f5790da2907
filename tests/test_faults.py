"""Faults of the trainer: killed checkpoint saves, damaged manifests and checkpoints, impossible config values,
undecodable data, resume with a changed config, safe trainer-state loading, a stop signal during start-up."""

import copy
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import dflash.components.checkpoint as ckpt_mod
from dflash.cli import main
from dflash.components.checkpoint import CheckpointManager, ensure_writable
from dflash.config import default_layer_ids, load_config
from dflash.data.chat import read_jsonl
from dflash.errors import BadInput, ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
DEAD_PID = 99_999_999  # above any pid_max: no such process


def payload(text):
    def write(tmp):
        (tmp / "model.safetensors").write_text(text)
        (tmp / "trainer_state.pt").write_text(text * 2)
    return write


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------ D1/D2: killed saves


class Killed(BaseException):
    """Stands for SIGKILL: raised at a phase of the save while no cleanup code can run."""


def _killed_save(monkeypatch, m: CheckpointManager, step: int, phase: str) -> None:
    """Save `step` and 'kill' it at `phase`; the on-disk state is what a SIGKILL there leaves."""
    write = payload(str(step))
    with monkeypatch.context() as mp:
        mp.setattr(ckpt_mod.shutil, "rmtree", lambda *a, **k: None)  # a killed process cleans nothing up
        if phase == "write":
            def write(tmp):  # noqa: F811 - killed half-way through the payload
                (tmp / "model.safetensors").write_text("part")
                raise Killed
        elif phase == "renamed-temp":  # temp dir complete with manifest, not yet renamed
            mp.setattr(ckpt_mod.os, "rename", lambda *a: (_ for _ in ()).throw(Killed()))
        elif phase == "pointer":  # renamed, `latest` not yet updated
            mp.setattr(CheckpointManager, "_write_latest", lambda self, name: (_ for _ in ()).throw(Killed()))
        elif phase == "prune":  # pointer updated, the oldest checkpoint half deleted
            def prune(self):
                (self.list()[0] / ckpt_mod.MANIFEST).unlink()
                raise Killed
            mp.setattr(CheckpointManager, "_prune", prune)
        with pytest.raises(Killed):
            m.save(step, write)


@pytest.mark.parametrize("phase, expected", [("write", 2), ("renamed-temp", 3), ("pointer", 3), ("prune", 3)])
def test_killed_save_resumes_newest_intact_and_leaves_no_temp(tmp_path, monkeypatch, phase, expected):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    _killed_save(monkeypatch, m, 3, phase)
    if phase in ("write", "renamed-temp"):
        assert [n for n in leftovers(tmp_path) if n.startswith(".tmp-step-00000003-")], leftovers(tmp_path)
    # next start
    m2 = CheckpointManager(tmp_path, keep_last=2)
    m2.recover()
    assert m2.latest_valid().name == f"step-{expected:08d}"
    assert leftovers(tmp_path) == []
    assert (tmp_path / "latest").read_text().strip() == f"step-{expected:08d}"
    m2.save(4, payload("4"))
    assert [p.name for p in m2.list()] == [f"step-{expected:08d}", "step-00000004"]


def test_pointer_lagging_behind_a_complete_checkpoint_is_not_trusted(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    (tmp_path / "latest").write_text("step-00000001\n")  # killed between the rename and the pointer update
    assert m.latest_valid().name == "step-00000002"


def test_stale_temp_dirs_are_removed_at_start_but_never_a_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    for name in (f".tmp-step-00000003-{DEAD_PID}", f".tmp-step-00000004-{os.getpid()}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("partial")
    (tmp_path / f".latest.tmp-{DEAD_PID}").write_text("step-00000003\n")
    (tmp_path / f".write-test-{DEAD_PID}").write_text("ok")
    m.recover()
    assert leftovers(tmp_path) == []
    assert [p.name for p in m.list()] == ["step-00000001", "step-00000002"]
    assert m.latest_valid().name == "step-00000002"


def test_a_probe_removed_by_another_nodes_recovery_does_not_fail_the_writable_check(tmp_path, monkeypatch):
    """A run directory shared by two nodes: node 0's reporter recovers checkpoints/ at start and removes every
    `.write-test-PID` whose PID is not alive in its own container, while a rank of node 1 checks that the
    directory is writable. Its probe can vanish between its write and its unlink; the write succeeded, so the
    check passes (the multinode scenario's relaunch failed on this: "not writable (No such file or directory)")."""
    real_write = Path.write_text

    def write_then_other_node_recovers(self, *args, **kwargs):
        written = real_write(self, *args, **kwargs)
        if self.name.startswith(".write-test-"):
            with monkeypatch.context() as m:
                m.setattr(ckpt_mod, "_alive", lambda pid: False)  # node 1's PID, seen from node 0
                assert CheckpointManager(self.parent).recover() == []  # a probe is not worth a log line
            assert not self.exists()
        return written

    monkeypatch.setattr(Path, "write_text", write_then_other_node_recovers)
    assert ensure_writable(tmp_path / "checkpoints") == tmp_path / "checkpoints"
    assert leftovers(tmp_path / "checkpoints") == []


def test_two_nodes_writing_one_shared_file_with_the_same_pid_use_two_temp_files(tmp_path, monkeypatch):
    """Two containers can give the processes that write one file of the shared run directory the same PID; each
    writes whole through its own temp file, and both renames succeed (the last one wins, both are whole)."""
    from dflash.fileio import atomic_file

    target = tmp_path / "regenerated" / "synthetic.jsonl"
    target.parent.mkdir()
    monkeypatch.setattr("socket.gethostname", lambda: "node0")
    first = atomic_file(target)
    fh0 = first.__enter__()
    fh0.write("from node 0\n")
    monkeypatch.setattr("socket.gethostname", lambda: "node1")
    with atomic_file(target) as fh1:  # node 1, the same PID, while node 0 is still writing
        fh1.write("from node 1\n")
    first.__exit__(None, None, None)
    assert target.read_text() == "from node 0\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["synthetic.jsonl"]


def test_resave_of_a_step_killed_between_the_renames_is_restored(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    # a kill after `step-2 -> .old-step-2-PID` and before `.tmp-step-2-PID -> step-2`
    os.rename(tmp_path / "step-00000002", tmp_path / f".old-step-00000002-{DEAD_PID}")
    m.recover()
    assert m.latest_valid().name == "step-00000002" and leftovers(tmp_path) == []


def test_resave_of_the_same_step_keeps_one_copy(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(2, payload("a"))
    m.save(2, payload("b"))
    assert (tmp_path / "step-00000002" / "model.safetensors").read_text() == "b"
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------ D3: garbage manifests

GARBAGE = {
    "random-bytes": b"\x8f\xff\x00\x13garbage\xfe",
    "list": b"[]",
    "null": b"null",
    "files-list": b'{"step": 2, "files": ["model.safetensors"]}',
    "empty-files": b'{"step": 2, "files": {}}',
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_manifest_is_damage_not_a_crash(tmp_path, kind):
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    (tmp_path / "step-00000002" / "manifest.json").write_bytes(GARBAGE[kind])
    if kind == "empty-files":
        (tmp_path / "step-00000002" / "model.safetensors").write_text("trunc")
    assert CheckpointManager.verify(tmp_path / "step-00000002") is not None
    assert m.latest_valid().name == "step-00000001"


# ------------------------------------------------------------------------------ a small trained run

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config dict, run dir) of a 6-step tiny run with checkpoints at steps 3 and 6."""
    from dflash.config import RunConfig, _build
    from dflash.training.trainer import Trainer

    data = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    base = tmp_path_factory.mktemp("trained")
    data["output_dir"] = str(base / "run")
    data["data"]["synthetic"]["num_samples"] = 200
    data["optim"]["max_steps"] = 6
    data["checkpoint"]["interval"] = 3
    data["logging"]["interval"] = 2
    data["eval"] = {"speculative_prompts": 0}
    Trainer(_build(RunConfig, copy.deepcopy(data), "")).setup().run()
    return data, Path(data["output_dir"])


@pytest.fixture
def run_copy(trained, tmp_path):
    """A private copy of the trained run: (config dict pointing at it, run dir, config file)."""
    data, src = trained
    data = copy.deepcopy(data)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    data["output_dir"] = str(run)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(data))
    return data, run, cfg_file


def test_trainer_and_export_fall_back_from_a_garbage_manifest(run_copy, tmp_path, capsys):
    from dflash.training.trainer import Trainer

    data, run, cfg_file = run_copy
    (run / "checkpoints" / "step-00000006" / "manifest.json").write_bytes(GARBAGE["random-bytes"])
    assert main(["export", str(run), str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["dflash_exported_from"] == "step-00000003"
    assert main(["export", str(run / "checkpoints" / "step-00000006"), str(tmp_path / "exp2")]) == 2
    assert "damaged" in capsys.readouterr().err
    trainer = Trainer(load_config(cfg_file)).setup()
    assert trainer.step == 3


def test_export_of_a_truncated_model_without_manifest_exits_2(run_copy, tmp_path, capsys):
    _, run, _ = run_copy
    step = run / "checkpoints" / "step-00000006"
    (step / "manifest.json").unlink()
    (step / "model.safetensors").write_bytes((step / "model.safetensors").read_bytes()[:100])
    assert main(["export", str(step), str(tmp_path / "exp")]) == 2
    assert capsys.readouterr().err.startswith("dflash: error: ")


# ------------------------------------------------------------------------------ D7: every checkpoint damaged

def test_all_checkpoints_damaged_stops_with_exit_2_unless_resume_false(run_copy, capsys):
    data, run, cfg_file = run_copy
    for step in (3, 6):
        model = run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"
        model.write_bytes(model.read_bytes()[:-10])
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert main(["train", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "every checkpoint in" in err and str(run / "checkpoints") in err
    assert "checkpoint.resume=false" in err
    assert {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == before
    assert json.loads((run / "heartbeat.json").read_text())["status"] == "failed"

    from dflash.training.trainer import Trainer

    assert Trainer(load_config(cfg_file, ["checkpoint.resume=false"])).setup().step == 0


# ------------------------------------------------------------------------------ D5: impossible values

@pytest.mark.parametrize("override, key", [
    ("optim.lr=.inf", "optim.lr"), ("optim.lr=.nan", "optim.lr"), ("optim.eps=-1e-8", "optim.eps"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("optim.min_lr_ratio=7", "optim.min_lr_ratio"),
    ("runtime.num_threads=-2", "runtime.num_threads"), ("optim.grad_clip=.nan", "optim.grad_clip"),
    ("optim.betas=[0.9, .nan]", "optim.betas[1]"), ("drafter.gamma=.inf", "drafter.gamma"),
])
def test_impossible_values_exit_2_naming_the_key(write_config, tiny_dict, tmp_path, capsys, override, key):
    tiny_dict["output_dir"] = str(tmp_path / "out")
    path = write_config(tiny_dict)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(path, [override])
    assert main(["train", str(path), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash: error: ") and key in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ D4/D14: data and YAML

def _chat(user="count by 1 from w1", answer="w1 w2 w3 w4 w5 w6 w7 w8 w9"):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_non_utf8_data_exits_3_data_error_naming_file_and_line(write_config, tiny_dict, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_bytes(json.dumps(_chat()).encode() + b"\n" + b'{"messages": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:2: not UTF-8"):
        read_jsonl(data)
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "out")
    assert main(["train", str(write_config(tiny_dict))]) == 3  # a data error (dflash/runtime/failures.py)
    err = capsys.readouterr().err
    assert f"{data}:2: not UTF-8" in err and err.count("\n") == 1 and "Traceback" not in err


def test_utf8_bom_is_tolerated(tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + json.dumps(_chat()).encode() + b"\n")
    assert len(read_jsonl(data)) == 1


def test_row_with_both_messages_and_conversations_is_rejected(tmp_path):
    data = tmp_path / "both.jsonl"
    row = {**_chat(), "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
    data.write_text(json.dumps(_chat()) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"both\.jsonl:2: has both 'messages' and 'conversations'"):
        read_jsonl(data)


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\noptim:\n  lr: [1,\n  eps: 2\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at at column" not in err, err
    assert str(bad) in err and "not valid YAML" in err and "line " in err and "column " in err


# ------------------------------------------------------------------------------ D12/D13: export

def test_export_onto_a_file_exits_2_and_exports_are_world_readable(run_copy, tmp_path, capsys):
    _, run, _ = run_copy
    target = tmp_path / "afile"
    target.write_text("x")
    assert main(["export", str(run), str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash: error: ") and err.count("\n") == 1 and "not a directory" in err
    old = os.umask(0o077)
    try:
        assert main(["export", str(run), str(tmp_path / "exp")]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "exp"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


# ------------------------------------------------------------------------------ D6: rejected inputs

def test_rejected_input_during_setup_leaves_a_failed_heartbeat_and_no_checkpoints_dir(write_config, tiny_dict,
                                                                                      tmp_path, capsys):
    tiny_dict["target"]["random_init"]["vocab_size"] = 40  # the synthetic tokenizer has more ids
    out = tmp_path / "out"
    tiny_dict["output_dir"] = str(out)
    assert main(["train", str(write_config(tiny_dict))]) == 2
    assert "outside the target's embedding table" in capsys.readouterr().err
    beat = json.loads((out / "heartbeat.json").read_text())
    assert beat["status"] == "failed" and "outside the target's embedding table" in beat["error"]
    assert not (out / "checkpoints").exists()


# ------------------------------------------------------------------------------ D11: changed config on resume

def test_changed_lr_on_resume_is_applied_and_logged(run_copy, capsys):
    from dflash.training.trainer import Trainer, cosine_schedule

    data, run, cfg_file = run_copy
    cfg = load_config(cfg_file, ["optim.lr=1e-3", "optim.eps=1e-6", "optim.weight_decay=0.1"])
    capsys.readouterr()
    trainer = Trainer(cfg).setup()
    assert trainer.step == 6
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("resume: optim")]
    assert len(lines) == 1 and "lr 0.003 -> 0.001" in lines[0], out
    factor = cosine_schedule(trainer.total_steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
    assert trainer.scheduler.base_lrs == [1e-3]
    for g in trainer.optimizer.param_groups:
        assert g["lr"] == pytest.approx(1e-3 * factor(6)) and g["eps"] == 1e-6 and g["weight_decay"] == 0.1
    # unchanged config: no line
    Trainer(load_config(cfg_file)).setup()
    assert "resume: optim" not in capsys.readouterr().out


def test_changed_drafter_shape_on_resume_exits_2_naming_the_key(run_copy, capsys):
    _, run, cfg_file = run_copy
    assert main(["train", str(cfg_file), "drafter.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drafter.num_layers is 3" in err and "new output_dir" in err


# ------------------------------------------------------------------------------ security: weights_only


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_trainer_state_loads_with_weights_only(run_copy, monkeypatch):
    from dflash.training.trainer import Trainer

    _, run, cfg_file = run_copy
    path = run / "checkpoints" / "step-00000006"
    state = torch.load(path / "trainer_state.pt", weights_only=True)  # no unsafe objects inside
    assert isinstance(state["rng"]["python"], list)
    seen = []
    real = torch.load

    def spy(*a, **k):
        seen.append(k.get("weights_only"))
        return real(*a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "load", spy)
    assert Trainer(load_config(cfg_file)).setup().step == 6
    assert seen == [True]


def test_older_tuple_rng_state_still_resumes_and_unsafe_state_is_refused(run_copy):
    import random

    from dflash.components.checkpoint import load_trainer_state
    from dflash.training.trainer import Trainer

    _, run, cfg_file = run_copy
    path = run / "checkpoints" / "step-00000006"
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    state["rng"]["python"] = random.getstate()  # the format of older checkpoints
    torch.save(state, path / "trainer_state.pt")
    (path / "manifest.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-00000003")

    def rewrite_manifest():
        files = {p.name: ckpt_mod._sha256(p) for p in path.iterdir() if p.name != "manifest.json"}
        (path / "manifest.json").write_text(json.dumps({"step": 6, "files": files}))

    rewrite_manifest()
    assert Trainer(load_config(cfg_file)).setup().step == 6
    torch.save({**state, "evil": _Evil()}, path / "trainer_state.pt")
    with pytest.raises(BadInput, match="not loaded for safety"):
        load_trainer_state(path)
    assert pickle  # (the refused object would run code when unpickled without weights_only)


# ------------------------------------------------------------------------------ D8: SIGTERM during start-up

def _catches_sigterm(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("extra_delay", [0.0, 1.0])
def test_sigterm_right_after_start_exits_0_without_traceback(write_config, tiny_dict, tmp_path, extra_delay):
    out = tmp_path / "run"
    tiny_dict["output_dir"] = str(out)
    cfg = write_config(tiny_dict)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    t0 = time.time()
    # the earliest moment the trainer can own a SIGTERM: its handler is in place (a loaded machine takes
    # seconds to start Python; before the handler the signal's default action would end it, as any program)
    while time.time() - t0 < 300 and not _catches_sigterm(proc.pid) and proc.poll() is None:
        time.sleep(0.005)
    time.sleep(extra_delay)  # 1 s: while torch imports and the models load
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    assert not list((out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else True
    if (out / "heartbeat.json").exists():
        assert json.loads((out / "heartbeat.json").read_text())["status"] == "stopped"


# ------------------------------------------------------------------------------ default layer ids

def test_default_layer_ids_use_pythons_round():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_layer_ids(94, 5) == [1, 24, 46, 68, 91]  # 22.5 and 68.5 round to even, as round()


# ------------------------------------------------------------------------------ D1/D2 with a real SIGKILL

# The save runs in a child that SIGKILLs itself at a phase: nothing of Python runs after the signal.
KILL_AT = r"""
import os, shutil, signal, sys
import dflash.components.checkpoint as ckpt
from dflash.components.checkpoint import CheckpointManager
directory, phase = sys.argv[1], sys.argv[2]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
m = CheckpointManager(directory, keep_last=2)
def write(tmp):
    (tmp / "model.safetensors").write_text("3")
    (tmp / "trainer_state.pt").write_text("33")
    if phase == "temp-partial":
        die()
if phase == "temp-written":  # complete with its manifest, fsynced, not yet renamed
    ckpt.os.rename = die
elif phase == "renamed":  # renamed into place, `latest` not yet updated
    CheckpointManager._write_latest = die
elif phase == "pointer-updated":  # `latest` names it, pruning not begun
    CheckpointManager._prune = die
elif phase == "pruning":  # the oldest checkpoint half deleted
    real = shutil.rmtree
    def rmtree(path, *a, **k):
        os.unlink(os.path.join(path, "manifest.json"))
        die()
    ckpt.shutil.rmtree = rmtree
m.save(3, write)
"""


@pytest.mark.parametrize("phase, expected", [("temp-partial", 2), ("temp-written", 3), ("renamed", 3),
                                             ("pointer-updated", 3), ("pruning", 3)])
def test_sigkill_inside_save_at_each_phase(tmp_path, phase, expected):
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(1, payload("1"))
    m.save(2, payload("2"))
    proc = subprocess.run([sys.executable, "-c", KILL_AT, str(tmp_path), phase], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if phase.startswith("temp"):
        assert any(n.startswith(".tmp-step-00000003-") for n in leftovers(tmp_path))
    # the next start: the newest intact checkpoint is resumed, no temp dir survives
    m2 = CheckpointManager(tmp_path, keep_last=2)
    m2.recover()
    assert m2.latest_valid().name == f"step-{expected:08d}"
    assert leftovers(tmp_path) == []
    assert (tmp_path / "latest").read_text().strip() == f"step-{expected:08d}"
    assert all(CheckpointManager.verify(p) is None or p.name == "step-00000001" for p in m2.list())


# ------------------------------------------------------------------------------ D9/D10: a full disk

FULL_DISK = r"""
set -u
mount -t tmpfs -o size={size} tmpfs "$1"
cd "$1"
{python} -m dflash train "$2" > "$3/out.log" 2> "$3/err.log" &
job=$!
{fill}
wait $job
echo $? > "$3/rc"
cp -a "$1"/. "$3"/
"""


def _full_disk_run(tmp_path, tiny_dict, size, fill="", **changes):
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private tmpfs")
    data = copy.deepcopy(tiny_dict)
    data["data"].pop("regenerate", None)
    data["data"]["synthetic"]["num_samples"] = 200
    data["optim"]["max_steps"] = 200
    data["logging"]["interval"] = 1
    data["eval"] = {"speculative_prompts": 0}
    mnt, copy_dir = tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    copy_dir.mkdir()
    data["output_dir"] = str(mnt / "run")
    for key, value in changes.items():
        data.setdefault(key.split(".")[0], {})[key.split(".")[1]] = value
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    script = FULL_DISK.format(size=size, python=sys.executable, fill=fill)
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(mnt), str(cfg),
                    str(copy_dir)], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, timeout=900)  # fmt: skip
    run = copy_dir / "run"
    return int((copy_dir / "rc").read_text()), (copy_dir / "err.log").read_text(), run


def _assert_clean_failure(rc, err, run, where):
    assert rc == 1, err
    assert err.strip().splitlines() == [err.strip().splitlines()[0]] and "Traceback" not in err, err
    assert err.startswith(f"dflash: error: no space left in {where}"), err
    beat = json.loads((run / "heartbeat.json").read_text())
    assert beat["status"] == "failed" and "no space left" in beat["error"], beat
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # every line whole: none cut off by the full disk
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_disk_full_while_checkpointing_names_the_directory(tmp_path, tiny_dict):
    # a checkpoint of the tiny run takes about 1 MB: the first save fills the 600 kB disk
    rc, err, run = _full_disk_run(tmp_path, tiny_dict, "600k", **{"checkpoint.interval": 3})
    _assert_clean_failure(rc, err, run, f"{tmp_path / 'mnt' / 'run' / 'checkpoints'} while saving checkpoint step-00000003")
    assert (run / "checkpoints").is_dir() and not list((run / "checkpoints").glob("step-*"))


def test_disk_full_while_logging_keeps_whole_lines_and_a_failed_heartbeat(tmp_path, tiny_dict):
    # no checkpoint before the disk is filled by another writer while the trainer logs every step
    fill = ('until grep -q "^step 3 " "$3/out.log" 2>/dev/null; do sleep 0.1; done; '
            'head -c 100M /dev/zero > filler 2>/dev/null; true')
    rc, err, run = _full_disk_run(tmp_path, tiny_dict, "2m", fill=fill, **{"checkpoint.interval": 1000})
    _assert_clean_failure(rc, err, run, f"{tmp_path / 'mnt' / 'run'} while writing metrics.jsonl")
