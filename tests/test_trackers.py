"""MLflow and Weights & Biases beside TensorBoard (dflash/runtime/trackers.py), with the real libraries offline: one tiny
recipe run logs the same scalars to all three (MLflow's local file store, W&B's offline run file read back), the
run config as parameters and the export as an artifact; a tracker that cannot be reached is one warning and the
run trains on; a wrong tracker name is a config error."""

from __future__ import annotations

import logging
import math
import socket
from collections import defaultdict
from pathlib import Path

import pytest

from dflash.config import ConfigError, load_config
from dflash.training.trainer import Trainer


def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_run(run: Path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = (run / "trackers" / "mlflow-run-id").read_text().strip()
    return client, client.get_run(run_id)


def wandb_records(path: Path) -> list:
    """The records of a W&B run file: its 7-byte header, then LevelDB log records (32 KiB blocks, each record a
    4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) holding `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
        elif kind == 0:
            break
    return records


def wandb_history(records) -> dict[str, dict[int, float]]:
    import json

    out: dict[str, dict[int, float]] = defaultdict(dict)
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
        step = items.pop("_step", record.history.step.num)
        for key, value in items.items():
            if not key.startswith("_"):
                out[key][int(step)] = value
    return dict(out)


def same(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> None:
    """Same tags, steps and values (TensorBoard keeps float32)."""
    assert sorted(a) == sorted(b)
    for tag in a:
        assert sorted(a[tag]) == sorted(b[tag]), tag
        for step, value in a[tag].items():
            assert math.isclose(value, b[tag][step], rel_tol=1e-6, abs_tol=1e-6), (tag, step, value, b[tag][step])


def test_mlflow_and_wandb_offline_hold_the_metrics_tensorboard_holds(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny_config
    cfg.optim.max_steps = 4
    cfg.eval.speculative_prompts = 2
    cfg.eval.max_new_tokens = 8
    cfg.logging.trackers = ["tensorboard", "mlflow", "wandb"]
    cfg.logging.wandb.mode = "offline"
    cfg.logging.run_name = "recipe-run"
    result = Trainer(cfg).setup().run()
    run = Path(cfg.output_dir)

    tb = tensorboard_scalars(run)
    assert {"train/loss", "train/tau", "train/tokens_per_s", "train/mem_gib", "acc/pos1", "eval/tau",
            "eval/acceptance_length"} <= set(tb)  # fmt: skip
    assert tb["eval/acceptance_length"][4] == pytest.approx(result["eval_acceptance_length"], rel=1e-6)

    client, mlrun = mlflow_run(run)
    assert mlrun.info.run_name == "recipe-run" and mlrun.info.status == "FINISHED"
    ml = {tag: {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, tag)} for tag in mlrun.data.metrics}
    same(tb, ml)
    assert mlrun.data.params["optim.lr"] == str(cfg.optim.lr)
    assert mlrun.data.params["drafter.block_size"] == str(cfg.drafter.block_size)
    exported = {a.path for a in client.list_artifacts(mlrun.info.run_id, "export")}
    assert {"export/config.json", "export/model.safetensors"} <= exported

    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    same(tb, wandb_history(records))
    kinds = {r.WhichOneof("record_type") for r in records}
    assert "artifact" in kinds
    config = {u.key: u.value_json for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update}
    assert config.get("optim.lr") == str(cfg.optim.lr)
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.display_name == "recipe-run"


def test_an_unreachable_tracker_is_one_warning_and_training_goes_on(tiny_config, tmp_path, monkeypatch, caplog):
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = tiny_config
    cfg.optim.max_steps = 4
    cfg.eval.speculative_prompts = 0
    cfg.logging.trackers = ["tensorboard", "mlflow"]
    cfg.logging.mlflow.tracking_uri = f"http://127.0.0.1:{port}"
    with caplog.at_level(logging.WARNING):
        result = Trainer(cfg).setup().run()
    assert result["step"] == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tracker mlflow" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
    assert tensorboard_scalars(Path(cfg.output_dir))["train/loss"]


def test_an_unreachable_wandb_is_one_warning_after_its_init_timeout(tiny_config, monkeypatch, caplog):
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config
    cfg.optim.max_steps = 2
    cfg.eval.speculative_prompts = 0
    cfg.logging.trackers = ["tensorboard", "wandb"]
    cfg.logging.wandb.mode = "online"
    cfg.logging.wandb.init_timeout = 3
    with caplog.at_level(logging.WARNING):
        result = Trainer(cfg).setup().run()
    assert result["step"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tracker wandb" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
    assert tensorboard_scalars(Path(cfg.output_dir))["train/loss"]


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(caplog):
    from dflash.runtime.trackers import RunTrackers, Tracker

    class Broken(Tracker):
        name = "broken"
        calls = 0

        def scalars(self, values, step):
            Broken.calls += 1
            raise ConnectionError("server went away")

    trackers = RunTrackers([Broken()])
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            trackers.scalars({"train/loss": 1.0}, step)
    assert Broken.calls == 1 and not trackers
    assert sum("tracker broken" in r.getMessage() for r in caplog.records) == 1


def test_the_trackers_key_is_validated(write_config, tiny_dict):
    tiny_dict["logging"]["trackers"] = ["tensorboard", "mlfow"]
    with pytest.raises(ConfigError, match=r"logging\.trackers\[1\]: must be one of .*mlflow"):
        load_config(write_config(tiny_dict))
    tiny_dict["logging"]["trackers"] = ["mlflow", "wandb"]
    tiny_dict["logging"]["wandb"] = {"mode": "offline", "project": "p"}
    cfg = load_config(write_config(tiny_dict))
    assert cfg.logging.trackers == ["mlflow", "wandb"] and cfg.logging.wandb.mode == "offline"


def test_suite_acceptance_lengths_go_to_the_runs_trackers(untrained_drafter, tmp_path, capsys):
    """`dflash eval --suite` with a config naming trackers: each suite's real acceptance length is a scalar
    `suite/NAME/acceptance_length` in the run's TensorBoard and MLflow run, equal to the JSON report's."""
    import json

    import yaml

    from dflash.cli import main

    config_path, drafter = untrained_drafter(tmp_path)
    config = yaml.safe_load(config_path.read_text())
    config["logging"]["trackers"] = ["tensorboard", "mlflow"]
    config_path.write_text(yaml.safe_dump(config))
    rows = tmp_path / "gsm8k.jsonl"
    rows.write_text("".join(json.dumps({"question": f"Natalia sold clips to {n} friends. How many?",
                                        "answer": f"#### {n}"}) + "\n" for n in (48, 12)))
    out = tmp_path / "suites.json"
    assert main(["eval", str(config_path), str(drafter), "--suite", f"gsm8k={rows}", "--suite-limit", "2",
                 "--max-new-tokens", "6", "--thinking", "off", "--out", str(out)]) == 0, capsys.readouterr()
    expected = json.loads(out.read_text())["suites"]["gsm8k"]["acceptance_length"]
    run = Path(config["output_dir"])
    assert tensorboard_scalars(run)["suite/gsm8k/acceptance_length"] == {0: pytest.approx(expected, rel=1e-6)}
    client, mlrun = mlflow_run(run)
    assert mlrun.data.metrics["suite/gsm8k/acceptance_length"] == pytest.approx(expected)
    assert mlrun.data.params["drafter.block_size"]  # the run config as parameters
