"""Real multi-process runs on CPU with gloo: `dflash train` starts torchrun itself.

* a 2-rank colocated run, a 1-target + 2-drafter disaggregated run and a target split by layers over 2
  target ranks feeding 2 drafter ranks follow the loss trajectory of a single-process run of the same global batch (grad_accum=2) step for step, and end with the same weights;
* a rank that raises ends the job non-zero, torchrun's summary names the rank and its error, and the last
  checkpoint is intact;
* SIGTERM stops every rank at one step boundary with a checkpoint, and the resumed run continues the
  uninterrupted trajectory (here with 2 target ranks feeding 1 drafter rank with grad_accum=2).

Two nodes by static rendezvous on the single-process trajectory (with a lost node and the resume) are proven
in real containers by molecule/multinode.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash.components.checkpoint import CheckpointManager
from dflash.config import RunConfig, _build, validate
from dflash.models.drafter import Drafter
from dflash.training.trainer import Trainer

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
COLOCATED = {"mode": "colocated", "nproc": 2, "timeout_s": 300}
DISAGGREGATED = {"mode": "disaggregated", "target_gpus": [0], "drafter_gpus": [1, 2], "timeout_s": 300}
# two producers feeding one drafter rank that accumulates 2 micro-batches: the same global batch again
TWO_PRODUCERS = {"mode": "disaggregated", "target_gpus": [0, 1], "drafter_gpus": [2], "timeout_s": 300,
                 "max_inflight": 1}
# one target split by layers over 2 stages, feeding 2 drafter ranks: the same global batch once more
TWO_STAGES = {"mode": "disaggregated", "target_gpus": [0, 1], "drafter_gpus": [2, 3], "timeout_s": 300,
              "target_stages": 2}


def tiny(output_dir: Path, topology: dict | None = None, **optim) -> dict:
    data = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    data["output_dir"] = str(output_dir)
    # topology tests compare splits of the same data: the synthetic answers as they are (data.regenerate runs
    # in colocated ranks only; tests/test_recipe.py covers it)
    data["data"].pop("regenerate", None)
    data["data"]["synthetic"]["num_samples"] = 200  # ~10 batches per epoch: the run crosses epochs
    data["optim"].update({"max_steps": STEPS, **optim})
    data["checkpoint"]["interval"] = 3
    data["logging"]["interval"] = 1
    data["runtime"]["num_threads"] = 1
    if topology:
        data["topology"] = topology
    return data


def write(data: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def spawn(config: Path, *overrides: str, fault: str | None = None, setup_fault: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DFLASH_") and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["DFLASH_FAULT_INJECT"] = fault
    if setup_fault:
        env["DFLASH_SETUP_FAULT_INJECT"] = setup_fault
    return subprocess.Popen([sys.executable, "-m", "dflash", "train", str(config), *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end within {limit}s:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - t0


def losses(output_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") != "eval"}


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return Drafter.load(CheckpointManager(output_dir / "checkpoints").latest_valid()).state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch: 2 micro-batches per step (grad_accum=2)."""
    out = tmp_path_factory.mktemp("single") / "run"
    cfg = _build(RunConfig, tiny(out, grad_accum=2), "")
    validate(cfg)
    result = Trainer(cfg).setup().run()
    assert result["step"] == STEPS
    return {"losses": losses(out), "weights": final_weights(out)}


@pytest.mark.parametrize("topology", [COLOCATED, DISAGGREGATED, TWO_STAGES],
                         ids=["colocated-2", "disaggregated-1t2d", "layer-split-2stages-2d"])
def test_loss_trajectory_matches_single_process(topology, reference, tmp_path):
    out = tmp_path / "run"
    rc, log, _ = finish(spawn(write(tiny(out, topology), tmp_path / "run.yaml")), 900)
    assert rc == 0, log[-4000:]
    got, want = losses(out), reference["losses"]
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    print(f"{topology['mode']}: " + " ".join(f"{s}:{got[s]:.5f}/{want[s]:.5f}" for s in sorted(want)))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    weights = final_weights(out)
    for name, value in reference["weights"].items():
        assert torch.allclose(weights[name], value, atol=1e-5, rtol=1e-4), name
    # only drafter rank 0 reports: one line per step in metrics.jsonl, one heartbeat
    assert json.loads((out / "heartbeat.json").read_text())["status"] == "finished"
    if topology is DISAGGREGATED:
        assert f"target rank 0/1: sent {2 * STEPS} micro-batches" in log
    if topology is TWO_STAGES:
        assert "target rank 0/2 (stage 0/2 of replica 0): layers 0..1 of replica 0" in log
        assert "target rank 1/2 (stage 1/2 of replica 0): layers 2..4 of replica 0" in log
        assert f"target rank 1/2 (stage 1/2 of replica 0): sent {2 * STEPS} micro-batches" in log


@pytest.mark.parametrize("topology,fault", [(COLOCATED, "1:4"), (DISAGGREGATED, "0:4"), (TWO_STAGES, "1:4")],
                         ids=["colocated-drafter-rank-1", "disaggregated-target-rank-0", "layer-split-stage-1"])
def test_a_crashing_rank_ends_the_job_and_names_itself(topology, fault, tmp_path):
    out = tmp_path / "run"
    rc, log, _ = finish(spawn(write(tiny(out, topology), tmp_path / "run.yaml"), fault=fault), 900)
    rank = fault.split(":")[0]
    assert rc == 1, log[-4000:]
    root_cause = log.split("Root Cause (first observed failure):", 1)[1]
    assert f"rank      : {rank} (local_rank: {rank})" in root_cause
    assert f"InjectedFault: injected fault (DFLASH_FAULT_INJECT={fault}) on rank {rank} after 4 steps" in root_cause
    assert "the distributed job failed" in log
    # the last checkpoint is intact: the interval one (step 3), or step 4 when the drafter ranks could still
    # agree on torchrun's SIGTERM at the end of step 4 (a target rank fails while producing ahead)
    ckpts = CheckpointManager(out / "checkpoints")
    last = ckpts.latest_valid()
    assert last is not None and last.name in ("step-00000003", "step-00000004") and ckpts.verify(last) is None
    assert Drafter.load(last).arch.block_size == 8
    if topology is TWO_STAGES:  # the stage ran from item 0 and raised at the first item of step 4
        assert "target rank 1/2 (stage 1/2 of replica 0): layers 2..4" in log
    assert torch.load(last / "trainer_state.pt", weights_only=False)["step"] == int(last.name[5:])
    assert json.loads((out / "heartbeat.json").read_text())["status"] == "failed"


STAGES_ONE_DRAFTER = {**TWO_STAGES, "drafter_gpus": [2], "max_inflight": 1}


@pytest.mark.parametrize("topology", [TWO_PRODUCERS, STAGES_ONE_DRAFTER], ids=["2-producers", "2-stages"])
def test_sigterm_checkpoints_every_rank_then_resume_continues_the_trajectory(topology, reference, tmp_path):
    out = tmp_path / "run"
    config = write(tiny(out, topology, grad_accum=2), tmp_path / "run.yaml")
    proc = spawn(config)
    heartbeat = out / "heartbeat.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if heartbeat.exists() and json.loads(heartbeat.read_text())["step"] >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0][-4000:]
    proc.send_signal(signal.SIGTERM)
    rc, log, elapsed = finish(proc, 900)
    assert rc == 0, log[-4000:]
    beat = json.loads(heartbeat.read_text())
    stopped_at = beat["step"]
    assert beat["status"] == "stopped" and 3 <= stopped_at < STEPS, log[-3000:]
    assert f"done: step {stopped_at} (stopped by signal, checkpoint saved)" in log
    assert "Traceback" not in log
    last = CheckpointManager(out / "checkpoints").latest_valid()
    assert last.name == f"step-{stopped_at:08d}"
    print(f"stopped at step {stopped_at}, {elapsed:.1f}s after SIGTERM")

    rc, log, _ = finish(spawn(config), 900)
    assert rc == 0, log[-4000:]
    assert f"resumed from {last} at step {stopped_at}" in log
    got, want = losses(out), reference["losses"]
    assert max(got) == STEPS
    for step in range(stopped_at + 1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    weights = final_weights(out)
    for name, value in reference["weights"].items():
        assert torch.allclose(weights[name], value, atol=1e-5, rtol=1e-4), name



@pytest.mark.slow
def test_a_hanging_rank_is_timed_out_not_waited_for(tmp_path):
    """Rank 1 stops answering: rank 0's all-reduce times out (topology.timeout_s), the job fails, and torchrun
    kills the hung rank after its grace; bounded by timeout_s + 30 s + start-up."""
    out = tmp_path / "run"
    topology = {**COLOCATED, "timeout_s": 30}
    rc, log, elapsed = finish(spawn(write(tiny(out, topology), tmp_path / "run.yaml"), fault="1:4:hang"), 900)
    assert rc == 5, log[-4000:]  # collective_timeout (dflash/runtime/failures.py): rank 0 failed first
    assert "rank 0 failed first, collective_timeout" in log
    assert "rank 1: hanging after 4 steps" in log
    assert "Timed out waiting 30000ms" in log.split("Root Cause (first observed failure):", 1)[1]
    assert CheckpointManager(out / "checkpoints").latest_valid().name == "step-00000003"
    print(f"hung job ended after {elapsed:.0f}s")


@pytest.mark.slow
def test_setups_further_apart_than_the_timeout_still_train(tmp_path):
    """Rank 0 sets up 30 s longer than rank 1 (its checkpoint recovery, a slower disk, a busier node) with
    topology.timeout_s 12: rank 1 waits in the setup barrier while rank 0 beats, and the job trains to its end.
    Without the barrier, rank 1's first all-reduce timed out after the timeout and the job failed at its start."""
    out = tmp_path / "run"
    data = tiny(out, {**COLOCATED, "timeout_s": 12})
    data["optim"]["max_steps"] = 3
    rc, log, _ = finish(spawn(write(data, tmp_path / "run.yaml"), setup_fault="0:30"), 900)
    assert rc == 0, log[-4000:]
    assert "rank 0: setting up 30s slower" in log
    assert "done: step 3" in log
    assert json.loads((out / "heartbeat.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_sigterm_before_the_ranks_run_stops_cleanly_after_one_step(tmp_path):
    """SIGTERM while the workers are still starting: each is told once its handler is in place; the ranks
    load, agree after one step, checkpoint it and exit 0."""
    out = tmp_path / "run"
    proc = spawn(write(tiny(out, COLOCATED), tmp_path / "run.yaml"))
    for line in proc.stdout:
        if line.startswith("dflash: starting"):
            break
    proc.send_signal(signal.SIGTERM)
    rc, log, _ = finish(proc, 900)
    assert rc == 0, log[-4000:]
    assert "done: step 1 (stopped by signal, checkpoint saved)" in log
    assert CheckpointManager(out / "checkpoints").latest_valid().name == "step-00000001"
