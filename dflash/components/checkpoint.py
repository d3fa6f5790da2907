"""Atomic checkpoints: temp dir, fsync, rename; keep the last N; a `latest` pointer; verified on load.

The manager is given the run's stateful parts (torchtitan's `CheckpointManager` is the model): the drafter
(saved in the export layout, config.json + model.safetensors) and named objects with `state_dict()` /
`load_state_dict()` (optimizer, scheduler, sampler, RNG), stored under their names in trainer_state.pt beside
the train state's own keys (step, config). `save_state(step)` writes them all, `load_state(path)` restores them.

Beside them a step directory holds `contract.json`, the run's resume contract: the settings that change the loss
or the drafter's layout (block size, gamma, anchors, loss implementation, tapped layers...), compared with the
config's on resume (`check_contract`). `checkpoints/best` names the checkpoint whose eval scored best (real
acceptance length): written atomically like `latest`, and that directory is never pruned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash.errors import BadInput, DiskFull
from dflash.fileio import atomic_file, out_of_space
from dflash.fileio import fsync_path as _fsync_path
from dflash.fileio import sha256_file as _sha256
from dflash.logs import get_logger
from dflash.models.drafter import Drafter, check_resumable

log = get_logger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step-"
# Only these directories are checkpoints (resumed from, pruned): anything else in checkpoints/ is left alone.
STEP_NAME = re.compile(r"step-[0-9]{8}")
TMP_PREFIX = ".tmp-"  # .tmp-step-NNNNNNNN-PID: a save in progress (or killed)
OLD_PREFIX = ".old-"  # .old-step-NNNNNNNN-PID: the previous copy of a step being re-saved
LATEST_TMP_PREFIX = ".latest.tmp-"
BEST_TMP_PREFIX = ".best.tmp-"
PROBE_PREFIX = ".write-test-"
CONTRACT = "contract.json"  # the resume contract of the run that wrote the checkpoint
BEST = "best"  # JSON: {"checkpoint": "step-NNNNNNNN", "step", "metric", "score", "time"}
# config keys of the contract whose change `checkpoint.allow_changed` may accept -> the drafter-architecture field
# that `check_resumable` would refuse unless told (the weights keep their shapes: only the layout changes)
ARCH_FIELD_OF_KEY = {"drafter.block_size": "block_size", "target.layer_ids": "target_layer_ids"}


def ensure_writable(directory: str | os.PathLike) -> Path:
    """Fail early (bad input) when checkpoints could not be written, before any model loads.

    Every rank checks; on a run directory shared by several nodes the reporter's `recover()` on node 0 may remove
    another node's probe between its write and its unlink (that node's PID is not alive in node 0's container):
    the write succeeded, so the directory is writable all the same."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{PROBE_PREFIX}{os.getpid()}"
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
    except OSError as exc:
        raise BadInput(f"checkpoint directory '{directory}' is not writable ({exc.strerror}); choose another "
                       "output_dir or fix its permissions") from None
    return directory


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class RNGState:
    """The torch (CPU), Python and CUDA generators, as plain lists: trainer_state.pt loads with weights_only."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = random.getstate()
        return {"torch": torch.random.get_rng_state(), "python": [version, list(internal), gauss_next],
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.random.set_rng_state(state["torch"])
        version, internal, gauss_next = state["python"]  # a list, or an older checkpoint's getstate() tuple
        random.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, keep_last: int = 3, model: Drafter | None = None,
                 states: dict[str, Stateful] | None = None, train_state: Stateful | None = None,
                 contract: dict[str, Any] | None = None):
        """`model`, `states` and `train_state` (its keys at the top level: step, config) are what
        `save_state`/`load_state` write and restore, and `contract` (config key -> value) is written beside
        them as contract.json; without them the manager only keeps directories."""
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.model = model
        self.states = dict(states or {})
        self.train_state = train_state
        self.contract = contract
        self._ignored: set[str] = set()  # stray names already warned about (one warning each)

    def save_state(self, step: int) -> Path:
        """A checkpoint of step `step` holding the model and every state (the order of restore is theirs)."""
        state = {**(self.train_state.state_dict() if self.train_state is not None else {}),
                 **{name: part.state_dict() for name, part in self.states.items()}}

        def write(tmp: Path) -> None:
            if self.model is not None:
                self.model.save(tmp)
            save_trainer_state(tmp, state)
            if self.contract is not None:  # inside the step directory: checksummed and renamed with the rest
                (tmp / CONTRACT).write_text(json.dumps(self.contract, indent=1, sort_keys=True) + "\n")

        return self.save(step, write)

    def load_state(self, path: Path, accepted: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
        """Restore the model (refusing a differently shaped one), then every state in the order given;
        returns the raw trainer state. `accepted`: contract keys whose change the user accepted
        (checkpoint.allow_changed); the drafter's own record of them is not held against the config."""
        if self.model is not None:
            loaded = Drafter.load(path, device=next(self.model.parameters()).device)
            saved_arch = loaded.arch
            for key in accepted:  # e.g. a new block size: same weights, the config's layout from now on
                if key in ARCH_FIELD_OF_KEY:
                    field_name = ARCH_FIELD_OF_KEY[key]
                    saved_arch = dataclasses.replace(saved_arch, **{field_name: getattr(self.model.arch, field_name)})
            check_resumable(saved_arch, self.model.arch, path)
            self.model.load_state_dict(loaded.state_dict())
        state = load_trainer_state(path)
        missing = [name for name in self.states if name not in state]
        if missing:
            raise BadInput(f"checkpoint {path} holds no {', '.join(missing)} state (not a dflash training "
                           "checkpoint of this version): start a new output_dir, or continue from its drafter with "
                           "drafter.init_from")
        for name, part in self.states.items():
            part.load_state_dict(state[name])
        if self.train_state is not None:
            self.train_state.load_state_dict(state)
        return state

    def path_for(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def save(self, step: int, write_fn) -> Path:
        """`write_fn(tmp_dir)` writes the payload; then manifest, fsync, rename, pointer, pruning."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            write_fn(tmp)
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            manifest = {"step": step, "files": {p.name: _sha256(p) for p in files}}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            for p in [*files, tmp / MANIFEST]:
                _fsync_path(p)
            _fsync_path(tmp)
            old = None
            if final.exists():  # re-saving the same step (e.g. SIGTERM right after an interval save)
                # moved aside, not deleted, until the new copy is in place: a kill between the two renames
                # leaves two complete copies under temp names, and `recover()` puts one back
                old = self.dir / f"{OLD_PREFIX}{final.name}-{os.getpid()}"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_path(self.dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as exc:
            full = out_of_space(exc, self.dir)
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise DiskFull(f"no space left in {self.dir} while saving checkpoint {final.name} (its partial copy "
                               "was removed; the earlier checkpoints are intact): free space there, lower "
                               "checkpoint.keep_last, or move output_dir") from None
            raise
        self._write_latest(final.name)
        self._prune()
        return final

    def _write_latest(self, name: str) -> None:
        self._write_pointer("latest", LATEST_TMP_PREFIX, name + "\n")

    def _write_pointer(self, name: str, tmp_prefix: str, text: str) -> None:
        """Temp file, fsync, rename over `name`, fsync the directory: a reader sees the old or the new text."""
        with atomic_file(self.dir / name, sync_dir=True, tmp=self.dir / f"{tmp_prefix}{os.getpid()}",
                         disk_full=False) as fh:
            fh.write(text)

    def _prune(self) -> None:
        """Keep the newest keep_last checkpoints, and the best one whatever its age."""
        best = self.best()
        kept = best["checkpoint"] if best is not None else None
        for old in self.list()[: -self.keep_last]:
            if old.name != kept:
                shutil.rmtree(old, ignore_errors=True)

    # ---------------------------------------------------------------------------------------- best
    def best(self) -> dict[str, Any] | None:
        """The `best` record ({"checkpoint", "step", "metric", "score", "time"}), or None when there is none
        (or it is unreadable: then the next eval's checkpoint becomes the best)."""
        pointer = self.dir / BEST
        if not pointer.is_file():
            return None
        try:
            record = json.loads(pointer.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not (isinstance(record, dict) and isinstance(record.get("checkpoint"), str)
                and STEP_NAME.fullmatch(record["checkpoint"]) and isinstance(record.get("score"), int | float)):
            return None
        return record

    def best_valid(self) -> Path | None:
        """The best checkpoint's directory when it is intact (what `dflash export` should prefer), else None."""
        record = self.best()
        if record is None:
            return None
        path = self.dir / record["checkpoint"]
        problem = self.verify(path) if path.is_dir() else "missing"
        if problem is not None:
            log.warning("best checkpoint %s is unusable (%s)", path, problem)
            return None
        return path

    def drop_best(self, reason: str) -> None:
        """Forget the best (its directory becomes an ordinary checkpoint), e.g. for a fresh start over an earlier
        run: its step numbers restart, and a re-saved step must not inherit the other run's score."""
        record = self.best()
        pointer = self.dir / BEST
        if not pointer.is_file():
            return
        pointer.unlink()
        _fsync_path(self.dir)
        was = f"{record['checkpoint']}, {record.get('metric')} {record['score']}" if record else "unreadable"
        log.warning("checkpoints %s: %s; the earlier best (%s) is no longer kept apart from pruning", self.dir,
                    reason, was)

    def beats_best(self, score: float, metric: str = "acceptance_length") -> bool:
        """Higher is better; a tie keeps the older best. A best of another metric is replaced."""
        best = self.best()
        return best is None or best.get("metric") != metric or score > best["score"]

    def keep_if_best(self, step: int, score: float, metric: str = "acceptance_length") -> bool:
        """Make checkpoint `step` (already saved) the best when `score` beats the recorded one. Order for a kill
        at any point: the new step directory is complete (renamed into place) before the pointer moves, and the
        previous best is pruned only after it has moved."""
        if not self.beats_best(score, metric):
            return False
        path = self.path_for(step)
        if not path.is_dir():  # a step directory exists only complete (renamed after its manifest and fsync)
            raise RuntimeError(f"checkpoint {path} must be saved before it is made the best")  # programming error
        record = {"checkpoint": path.name, "step": step, "metric": metric, "score": score, "time": time.time()}
        self._write_pointer(BEST, BEST_TMP_PREFIX, json.dumps(record) + "\n")
        self._prune()  # the previous best is an ordinary checkpoint now
        return True

    def recover(self) -> list[str]:
        """At start: finish or undo what a killed save left behind; returns what was done (for the log).

        A temp dir of a killed save is removed, unless it is a complete copy of a step that is missing (a kill
        between the renames of a re-save): then it is renamed into place. Step directories are never removed
        here, and the `latest` pointer is set to the newest intact checkpoint when it lags behind it."""
        done: list[str] = []
        if not self.dir.is_dir():
            return done
        for entry in sorted(self.dir.iterdir()):
            name = entry.name
            if not name.startswith((TMP_PREFIX, OLD_PREFIX, LATEST_TMP_PREFIX, BEST_TMP_PREFIX, PROBE_PREFIX)):
                continue
            pid = name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue  # another live process is writing it
            if name.startswith((LATEST_TMP_PREFIX, BEST_TMP_PREFIX, PROBE_PREFIX)):
                entry.unlink(missing_ok=True)
                continue
            step_name = name.removeprefix(TMP_PREFIX).removeprefix(OLD_PREFIX).rsplit("-", 1)[0]
            final = self.dir / step_name
            if (entry.is_dir() and STEP_NAME.fullmatch(step_name) and not final.exists()
                    and self.verify(entry) is None):
                os.rename(entry, final)
                done.append(f"restored {final.name} from {name}")
            else:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                done.append(f"removed {name}")
        newest = self.latest_valid()
        pointer = self.dir / "latest"
        if newest is not None and (not pointer.is_file() or pointer.read_text().strip() != newest.name):
            self._write_latest(newest.name)
            done.append(f"latest -> {newest.name}")
        done += self._recover_best()
        if done:
            _fsync_path(self.dir)
            log.warning("checkpoints %s: recovered from an interrupted save: %s", self.dir, "; ".join(done))
        return done

    def _recover_best(self) -> list[str]:
        """A `best` pointer to a checkpoint that is gone, damaged or unreadable is dropped (the directory itself
        stays, an ordinary checkpoint): the next eval then picks a new best instead of comparing with a ghost."""
        pointer = self.dir / BEST
        if not pointer.is_file():
            return []
        record = self.best()
        problem = "unreadable" if record is None else None
        if record is not None:
            path = self.dir / record["checkpoint"]
            problem = self.verify(path) if path.is_dir() else f"{record['checkpoint']} is missing"
        if problem is None:
            return []
        pointer.unlink(missing_ok=True)
        return [f"dropped the best pointer ({problem})"]

    def list(self) -> list[Path]:
        """The checkpoints, oldest first: directories named exactly step-NNNNNNNN (8 digits).

        Anything else is never resumed from and never pruned; what looks like a checkpoint but is not one
        (step-latest, step-backup, step-1, a copy made by hand) gets one warning naming it. Other entries (the
        `latest` pointer, a save's temp names, a run directory's files when export searches one) are not warned
        about."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            if STEP_NAME.fullmatch(p.name) and p.is_dir():
                found.append(p)
            elif p.name.startswith("step") and p.name not in self._ignored:
                self._ignored.add(p.name)
                log.warning("checkpoints %s: %s is not a checkpoint (only step-NNNNNNNN directories are); "
                            "it is ignored: never resumed from, never pruned", self.dir, p.name)
        return sorted(found)

    @staticmethod
    def verify(path: Path) -> str | None:
        """None when intact, else the reason. Any manifest that is not a mapping of every payload file to its
        checksum (garbage, `[]`, `null`, `files` not a mapping, files left out) makes the checkpoint damaged."""
        manifest = path / MANIFEST
        if not manifest.is_file():
            return "no manifest (partial write)"
        try:
            data = json.loads(manifest.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"unreadable manifest ({exc})"
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict) or not files:
            return "manifest lists no files (damaged manifest)"
        if not all(isinstance(k, str) and isinstance(v, str) and "/" not in k for k, v in files.items()):
            return "manifest is malformed"
        try:
            present = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST}
        except OSError as exc:
            return f"unreadable directory ({exc.strerror})"
        unlisted = sorted(present - set(files))
        if unlisted:
            return f"manifest does not list {', '.join(unlisted)} (damaged manifest)"
        for name, digest in files.items():
            f = path / name
            if not f.is_file():
                return f"missing {name}"
            try:
                if _sha256(f) != digest:
                    return f"checksum mismatch in {name}"
            except OSError as exc:
                return f"unreadable {name} ({exc.strerror})"
        return None

    def latest_valid(self) -> Path | None:
        """Newest intact checkpoint; corrupt or partial ones are skipped with a warning.

        The `latest` pointer is not trusted to be current: a kill between the rename of a new checkpoint and
        the pointer update leaves it one behind, and a renamed step directory is complete (renamed after its
        manifest and fsync), so the newest intact directory wins."""
        for path in reversed(self.list()):
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, problem)
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_trainer_state(path: Path, state: dict[str, Any]) -> None:
    torch.save(state, path / "trainer_state.pt")


def load_trainer_state(path: Path) -> dict[str, Any]:
    """Loaded with weights_only=True: a checkpoint directory must not be able to run code on load."""
    try:
        return torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise BadInput(f"trainer state {path / 'trainer_state.pt'} holds objects that are not loaded for safety "
                       f"({str(exc).splitlines()[0][:200]}); it was not written by this dflash: start a new "
                       "output_dir, or export the drafter and continue from it with drafter.init_from") from None


# ------------------------------------------------------------------------------------------ resume contract
def read_contract(path: Path) -> dict[str, Any] | None:
    """The resume contract a checkpoint was written with; None for a checkpoint of an earlier dflash."""
    file = Path(path) / CONTRACT
    if not file.is_file():
        return None
    record = json.loads(file.read_text())  # checksummed by the manifest: verify() vouched for it
    if not isinstance(record, dict):
        raise BadInput(f"{file} is not a mapping of config keys (not written by dflash): restore the checkpoint, "
                       "or start a new output_dir")
    return record


def contract_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (the checkpoint's value, the config's value) for every key whose value differs. A key one side
    lacks is None (unset) there: a setting added after the checkpoint was written trained with its default."""
    def plain(value: Any) -> Any:  # tuples vs lists, ints vs floats: compared as JSON writes them
        return json.loads(json.dumps(value))

    changes = {}
    for key in sorted(set(saved) | set(current)):
        old, new = plain(saved.get(key)), plain(current.get(key))
        if old != new and not (isinstance(old, int | float) and isinstance(new, int | float) and float(old) == float(new)):
            changes[key] = (old, new)
    return changes


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def _contract_refusal(path: Path, refused: dict[str, tuple[Any, Any]], notes: dict[str, str],
                      fixed: tuple[str, ...] | list[str]) -> str:
    """One line, in the words of the drafter-shape refusal ("drafter.num_layers is 3 but the checkpoint ... was
    trained with 2"), which the deploy's rollback check (molecule/faults) and operators already read."""
    parts = [f"{key} is {_shown(new)}{notes.get(key, '')} but " + (f"the checkpoint {path} was" if i == 0 else "it was")
             + f" trained with {_shown(old)}" for i, (key, (old, new)) in enumerate(refused.items())]
    back = ", ".join(f"{key}={json.dumps(old)}" for key, (old, _) in refused.items())
    fixes = [f"set it back ({back})", "use a new output_dir"]
    acceptable = [key for key in refused if key not in fixed]
    if acceptable == list(refused):
        fixes.append(f"accept the change with checkpoint.allow_changed=[{','.join(acceptable)}]")
    return (f"{'; '.join(parts)} (the resume contract: it changes the loss or the layout mid-run); "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")


def check_contract(path: Path, current: dict[str, Any], allowed: list[str] | tuple[str, ...] = (),
                   notes: dict[str, str] | None = None, fixed: tuple[str, ...] | list[str] = (),
                   proven: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """Compare checkpoint `path`'s contract with the config's; returns the changes the user accepted
    (checkpoint.allow_changed), key -> (the checkpoint's value, the config's). Any other change is a BadInput
    naming the key, both values and the fixes: a resume that silently changed the loss or the layout would mix two
    runs in one drafter. `notes`: a few words per key shown beside the config's value (e.g. how a default was
    resolved); `fixed`: keys no override can accept (their fix does not offer checkpoint.allow_changed); `proven`:
    values the checkpoint's own files prove (its drafter config.json), which win over its contract.json."""
    saved = read_contract(path)
    if saved is not None and proven:
        saved = {**{k: v for k, v in saved.items() if k not in proven},
                 **{k: v for k, v in proven.items() if v is not None}}
    if saved is None:
        log.warning("checkpoint %s holds no %s (written by an earlier dflash): resuming without checking that %s "
                    "are unchanged", path, CONTRACT, ", ".join(sorted(current)))
        return {}
    changes = contract_changes(saved, current)
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if refused:
        raise BadInput(_contract_refusal(path, refused, notes or {}, fixed))
    return {k: v for k, v in changes.items() if k in allowed}
