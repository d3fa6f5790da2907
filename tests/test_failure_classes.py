"""Failure classes (dflash/runtime/failures.py): every end of the trainer has a class and its exit code, written into the
heartbeat before the exit; the unit's restart policy reads the code (tests/ansible/test_ansible_failure_classes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from dflash.cli import main
from dflash.runtime import failures
from dflash.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _beat(run: Path) -> dict:
    return json.loads((run / "heartbeat.json").read_text())


def test_the_class_table_is_the_one_module_utils_mirrors():
    sys.path.insert(0, str(ROOT / "module_utils"))
    try:
        import dflash_failures
    finally:
        sys.path.remove(str(ROOT / "module_utils"))
    assert dflash_failures.EXIT_CODES == failures.EXIT_CODES
    assert dflash_failures.SIGNAL == failures.SIGNAL
    for status in (None, 0, 1, 2, 3, 4, 5, 6, 7, 137, 143):
        assert dflash_failures.class_of_exit(status) == failures.class_of_exit(status), status


def test_out_of_memory_at_step_3_exits_4_with_the_class_and_the_setting_to_lower(write_config, tiny_dict, tmp_path,
                                                                                 monkeypatch, capsys):
    """torch.OutOfMemoryError (what torch.cuda raises), raised on a CPU by a patched step 3."""
    step = Trainer.train_step

    def train_step(self):
        if self.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["optim"]["max_steps"] = 6
    assert main(["train", str(write_config(tiny_dict))]) == failures.EXIT_CODES["cuda_oom"] == 4
    beat = _beat(tmp_path / "run")
    assert beat["status"] == "failed" and beat["failure_class"] == "cuda_oom" and beat["step"] == 2
    assert "lower data.token_budget" in beat["error"]
    err = capsys.readouterr().err
    assert "dflash: error: cuda_oom: CUDA out of memory: lower data.token_budget" in err


def test_a_bad_data_line_is_a_data_error_exit_3(write_config, tiny_dict, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "count"}]}\n{not json}\n')
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "regenerate": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "run")
    assert main(["train", str(write_config(tiny_dict))]) == failures.EXIT_CODES["data_error"] == 3
    assert f"{data}:2: malformed JSON" in capsys.readouterr().err
    beat = _beat(tmp_path / "run")
    assert beat["status"] == "failed" and beat["failure_class"] == "data_error"


def test_a_real_gloo_collective_timeout_is_classified(tmp_path):
    """Two gloo ranks in one process (threads, a HashStore): rank 0's all-reduce without its peer times out (1 s).
    In a child process: a process group left behind aborts the interpreter at its exit."""
    script = textwrap.dedent("""
        import datetime, json, os, sys, threading
        import torch, torch.distributed as dist
        from dflash.runtime.failures import classify
        store, groups = dist.HashStore(), {}
        def make(rank):
            groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, datetime.timedelta(seconds=1))
        threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        try:
            groups[0].allreduce([torch.ones(3)]).wait()
            print(json.dumps({"class": None}))
        except Exception as exc:
            print(json.dumps({"class": classify(exc), "message": str(exc)}))
        sys.stdout.flush()
        os._exit(0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["class"] == "collective_timeout", (got, r.stderr[-2000:])
    assert "Timed out waiting" in got["message"]


def test_classes_of_exceptions_and_exits(monkeypatch):
    assert failures.classify(RuntimeError("[gloo/transport/tcp/pair.cc:598] Timed out waiting 30000ms for recv "
                                          "operation to complete")) == "collective_timeout"
    assert failures.classify(RuntimeError("CUDA error: an illegal memory access was encountered")) == "gpu_error"
    assert failures.classify(RuntimeError("CUDA error: uncorrectable ECC error encountered")) == "gpu_error"
    assert failures.classify(torch.OutOfMemoryError("CUDA out of memory")) == "cuda_oom"
    assert failures.classify(torch.cuda.OutOfMemoryError("x")) == "cuda_oom"
    # known only by its text: a library that re-raises the allocator's error as a plain RuntimeError (e.g. inside a
    # compiled region or a NCCL call), and a subclass of RuntimeError that is not torch's
    assert failures.classify(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.1 GiB total "
                                          "capacity)")) == "cuda_oom"
    assert failures.classify(type("CompiledError", (RuntimeError,), {})("CUDA out of memory")) == "cuda_oom"
    assert failures.classify(ValueError("something else")) == "unknown"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert failures.describe("gpu_error", RuntimeError("CUDA error: unspecified launch failure")).startswith(
        "gpu_error on cuda:1")
    assert [failures.class_of_exit(s) for s in (0, 1, 2, 3, 4, 5, 6, 9, 137)] == \
        [None, "unknown", "bad_input", "data_error", "cuda_oom", "collective_timeout", "gpu_error", "unknown", "signal"]


def test_the_launcher_exits_with_the_class_of_the_rank_that_failed_first(tmp_path):
    failures.write_rank_failure(str(tmp_path), 1, "collective_timeout", "Timed out waiting")
    first = failures.first_rank_failure(str(tmp_path))
    assert first["rank"] == 1 and first["failure_class"] == "collective_timeout"
    failures.clear_rank_failures(str(tmp_path))
    assert failures.first_rank_failure(str(tmp_path)) is None


def test_dflash_ops_shows_the_class_in_the_job_line():
    from dflash.ops.results import FAILED, ContainerStatus, _apply_unit_fields, _describe

    c = ContainerStatus(host="ct1", state=FAILED)
    _apply_unit_fields(c, {"active_state": "failed", "exit_status": 4, "restarts": 1, "failure_class": "cuda_oom",
                           "last_exit_reason": "exit-code (exited 4)", "crash_loop": True})
    assert c.failure_class == "cuda_oom"
    assert "exit status 4 (cuda_oom)" in _describe(c)



def test_the_launcher_returns_the_class_of_the_first_failed_rank(tiny_config, monkeypatch, capsys):
    """launch_torchrun with a stand-in for torchrun that exits 1 (as torchrun does whichever rank failed) after a
    rank recorded out of memory: the launcher's exit is the class's code, not torchrun's 1."""
    from dflash import launch
    from dflash.runtime.topology import plan_ranks

    out = tiny_config.output_dir
    failures.write_rank_failure(out, 3, "gpu_error", "a stale record of an earlier launch")  # cleared at the start
    script = ("import sys; from dflash.runtime import failures; "
              f"failures.write_rank_failure({out!r}, 1, 'cuda_oom', 'cuda_oom: CUDA out of memory'); sys.exit(1)")
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", script])
    rc = launch.launch_torchrun(tiny_config, "unused.yaml", [], plan_ranks(tiny_config.topology))
    assert rc == failures.EXIT_CODES["cuda_oom"]
    assert "rank 1 failed first, cuda_oom" in capsys.readouterr().err


def _documented_codes(doc: Path, class_col: int, code_col: int, heading: str) -> dict[str, str]:
    """The exit-code table under `heading` in a doc: class -> code, as written."""
    text = doc.read_text()
    assert heading in text, f"{doc.name} lost its table under {heading!r}"
    rows = {}
    started = False
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cells[class_col].strip("`")
            if name in ("class", "---", "-"):
                continue
            rows[name] = cells[code_col]
        elif started:
            break
    return rows


def test_the_documented_exit_codes_are_the_code_s():
    """docs/architecture.md's exit-code table and docs/operations.md's failure classes say what failures.py does:
    a class added, renumbered or dropped in the code fails here until both docs follow."""
    expected = {name: str(code) for name, code in failures.EXIT_CODES.items()} | {failures.SIGNAL: "128+N"}
    arch = _documented_codes(ROOT / "docs" / "architecture.md", 1, 0, "### Exit codes")
    assert arch == expected
    ops = _documented_codes(ROOT / "docs" / "operations.md", 0, 1, "| class | exit | how it is detected")
    assert ops == expected
