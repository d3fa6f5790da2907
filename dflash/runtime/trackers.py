"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases (`logging.trackers`, the optional extras
`mlflow` and `wandb`). The reporting rank's RunObserver hands every scalar it writes to TensorBoard to each tracker
under the same tag (`train/loss`, `acc/pos1`, `eval/acceptance_length`, ...), the run config as parameters at the
start, and the final export as an artifact at the end.

A tracker never stops training: one that cannot be imported, reached or written to is dropped with one warning; the
metrics stay in metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from dflash.fileio import atomic_file
from dflash.logs import get_logger

log = get_logger(__name__)

TRACKERS = ("tensorboard", "mlflow", "wandb")
# the file in OUTPUT_DIR/trackers/ that keeps a tracker's run id, so a resumed job logs into the same run
RUN_ID_FILE = "{name}-run-id"


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """`{"optim": {"lr": 6e-4}}` -> `{"optim.lr": 6e-4}` (lists kept whole)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


class Tracker:
    """One experiment tracker; each method may raise (RunTrackers drops it then)."""

    name = "tracker"

    def params(self, params: dict[str, Any]) -> None: ...

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def artifact(self, path: Path, name: str) -> None: ...

    def close(self, failed: bool) -> None: ...


def _run_id_path(out_dir: Path, name: str) -> Path:
    return out_dir / "trackers" / RUN_ID_FILE.format(name=name)


def _remember_run_id(out_dir: Path, name: str, run_id: str) -> None:
    path = _run_id_path(out_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:  # a start killed here leaves the old id or the new one, never half of one
        fh.write(run_id + "\n")


def _known_run_id(out_dir: Path, name: str) -> str | None:
    try:
        return _run_id_path(out_dir, name).read_text().strip() or None
    except OSError:
        return None


class MlflowTracker(Tracker):
    """MLflow through its client (no global active run): `logging.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI,
    else a local file store OUTPUT_DIR/mlruns."""

    name = "mlflow"

    def __init__(self, out_dir: Path, run_name: str, options: Any):
        uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
        # an unreachable server: fail within seconds, not after minutes of retries (the tracker is dropped then)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import mlflow
        from mlflow.entities import Metric, Param, RunStatus

        self._metric, self._param, self._status = Metric, Param, RunStatus
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.uri = uri
        run_id = _known_run_id(out_dir, self.name)
        self.resumed = False
        if run_id is not None:
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                self.resumed = True
            except Exception:  # another store, or the run was deleted: a new run
                run_id = None
        if run_id is None:
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(options.experiment)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            _remember_run_id(out_dir, self.name, run_id)
        self.run_id = run_id

    def params(self, params: dict[str, Any]) -> None:
        if self.resumed:  # MLflow's parameters are written once; the resumed run has them
            return
        items = [self._param(key[:250], str(value)[:6000]) for key, value in flatten(params).items()]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 parameters
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def scalars(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, float(v), now, step) for k, v in values.items()])

    def artifact(self, path: Path, name: str) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path=name)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """Weights & Biases: `logging.wandb.project`/`entity`/`mode` (null: WANDB_MODE, else online); the run's files
    under OUTPUT_DIR/wandb."""

    name = "wandb"

    def __init__(self, out_dir: Path, run_name: str, options: Any):
        import wandb

        run_id = _known_run_id(out_dir, self.name) or secrets.token_hex(4)
        _remember_run_id(out_dir, self.name, run_id)
        self._wandb = wandb
        self.run = wandb.init(project=options.project, entity=options.entity, name=run_name, id=run_id,
                              resume="allow", dir=str(out_dir), mode=options.mode,
                              settings=wandb.Settings(silent=True, init_timeout=options.init_timeout, console="off"))

    def params(self, params: dict[str, Any]) -> None:
        self.run.config.update(flatten(params), allow_val_change=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def artifact(self, path: Path, name: str) -> None:
        art = self._wandb.Artifact(f"{self.run.name or 'dflash'}-{name}".replace("/", "-"), type="model")
        art.add_dir(str(path))
        self.run.log_artifact(art)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


OPENERS = {"mlflow": MlflowTracker, "wandb": WandbTracker}
EXTRAS = {"mlflow": "mlflow-skinny", "wandb": "wandb"}


class RunTrackers:
    """The run's trackers other than TensorBoard; a failing one is dropped with one warning."""

    def __init__(self, trackers: list[Tracker] | None = None):
        self.trackers = list(trackers or [])

    @classmethod
    def open(cls, names: list[str], out_dir: str | os.PathLike, run_name: str, options: Any) -> RunTrackers:
        out = Path(out_dir)
        opened = []
        for name in dict.fromkeys(names):
            if name not in OPENERS:
                continue
            try:
                opened.append(OPENERS[name](out, run_name, getattr(options, name)))
            except ImportError as exc:
                log.warning(f"tracker {name}: not installed ({exc}); install the extra: pip install "
                            f"'dflash-trainer[{name}]' ({EXTRAS[name]}). Training goes on; metrics in metrics.jsonl "
                            f"and TensorBoard")
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                log.warning(f"tracker {name}: cannot start ({type(exc).__name__}: {_first_line(exc)}); training goes "
                            f"on without it, metrics in metrics.jsonl and TensorBoard")
        return cls(opened)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                self.trackers.remove(tracker)
                log.warning(f"tracker {tracker.name}: {what} failed ({type(exc).__name__}: {_first_line(exc)}); it is "
                            f"dropped for the rest of the run, metrics stay in metrics.jsonl and TensorBoard")

    def params(self, params: dict[str, Any]) -> None:
        self._each("logging the run config", lambda t: t.params(params))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if values:
            self._each("logging metrics", lambda t: t.scalars(values, step))

    def artifact(self, path: Path, name: str) -> None:
        self._each(f"uploading {name}", lambda t: t.artifact(path, name))

    def close(self, failed: bool = False) -> None:
        self._each("closing the run", lambda t: t.close(failed))
        self.trackers = []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


def open_trackers(config: Any) -> RunTrackers:
    """The trackers `logging.trackers` names (a RunConfig), started with the run config as their parameters."""
    logging = config.logging
    trackers = RunTrackers.open(logging.trackers, config.output_dir,
                                logging.run_name or Path(config.output_dir).resolve().name, logging)
    if trackers:
        trackers.params(config.to_dict())
    return trackers


SUITE_METRICS = ("acceptance_length", "speedup", "target_tokens_per_s", "speculative_tokens_per_s")


def suite_scalars(results: list[dict[str, Any]]) -> dict[str, float]:
    """`dflash eval --suite`'s results as scalars: `suite/NAME/acceptance_length`, ... (numbers only)."""
    return {f"suite/{r['suite']}/{key}": float(r[key]) for r in results for key in SUITE_METRICS
            if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)}


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint directory (`step-00000400`, or what `best` names), else 0."""
    name = Path(path).resolve().name
    digits = name.rsplit("-", 1)[-1]
    return int(digits) if digits.isdigit() else 0
