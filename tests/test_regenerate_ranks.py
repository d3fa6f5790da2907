"""`dflash regenerate --nproc 2` stopped by SIGTERM: the one torchrun launcher (dflash/runtime/torchrun.py) passes the
signal on to each rank, each rank stops after the shard it is writing (dflash/runtime/stop.py), and a rerun resumes to
the output an uninterrupted single-process run writes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.data.synthetic import generate_conversations

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.mark.distributed
def test_sigterm_stops_every_rank_after_its_shard_and_a_rerun_resumes(tmp_path):
    convs = [r["messages"] for r in generate_conversations(40, 64, 4, 10, [1, 2], seed=5)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    args = ["--target-config", str(TINY), "--max-new-tokens", "16", "--shard-size", "2", "--batch-size", "1"]
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    cmd = [sys.executable, "-m", "dflash", "regenerate", str(inp), str(out), *args, "--nproc", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "out.jsonl.parts"
    deadline = time.monotonic() + 300
    while not list(parts.glob("shard-*.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    assert f"dflash: signal {signal.SIGTERM}: stopping the ranks" in err  # the launcher passed it on
    for rank in (0, 1):  # each rank stopped by the signal itself, and says so
        assert f"rank {rank}: stopped by signal {signal.SIGTERM}" in err and "rerun the same command" in err
    assert "exitcode  : -15" not in err  # no rank died of torchrun's SIGTERM after the first one ended
    done = {p.name: p.stat().st_mtime_ns for p in parts.glob("shard-*.jsonl")}
    assert 1 <= len(done) < 20 and not out.exists() and not list(parts.glob(".*tmp*"))
    for shard in parts.glob("shard-*.jsonl"):  # every shard file is complete
        assert all(json.loads(line)["messages"] for line in shard.read_text().splitlines())

    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "shards done before, skipped" in rerun.stderr
    assert {n: (parts / n).stat().st_mtime_ns for n in done} == done  # finished shards were not rewritten
    single = subprocess.run([sys.executable, "-m", "dflash", "regenerate", str(inp), str(ref), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    assert out.read_bytes() == ref.read_bytes()
