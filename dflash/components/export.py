"""Export a checkpoint as a serving drafter directory: config.json + model.safetensors + modeling_dflash.py.

The layout is that of the public DFlash checkpoints (e.g. z-lab/Qwen3-8B-DFlash-b16): `architectures:
["DFlashDraftModel"]`, `model_type: qwen3`, `block_size` and `dflash_config: {target_layer_ids, mask_token_id,
block_size}`, and an `auto_map` that points transformers at the shipped modeling file, so that
`AutoModel.from_pretrained(OUT, trust_remote_code=True)` loads it (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dflash.components.checkpoint import CheckpointManager
from dflash.errors import BadInput
from dflash.fileio import raise_if_full
from dflash.logs import get_logger
from dflash.models.drafter import Drafter, DrafterArch
from dflash.models.target import DTYPES

log = get_logger(__name__)

MODELING_FILE = Path(__file__).resolve().parents[1] / "models" / "hf_remote" / "modeling_dflash.py"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def auto_map_of(config: dict) -> dict:
    """The shipped modeling file's class for the config's architecture (DFlashDraftModel or DFlash2DraftModel)."""
    return {"AutoModel": f"modeling_dflash.{config['architectures'][0]}"}


def choose_checkpoint(path: str | os.PathLike, which: str = "best") -> tuple[Path, str]:
    """The checkpoint `path` names and why, in a few words for the line that says which one was taken.

    A step or export directory is taken as it is. A run directory or its checkpoints directory: with
    `which="best"` (what `dflash eval` and `dflash export` take) the checkpoint with the best real acceptance
    length (`checkpoints/best`) where the run kept an intact one, else the newest intact checkpoint; with
    `which="latest"` (their `--latest`) the newest."""
    p = Path(path)
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        problem = CheckpointManager.verify(p) if (p / "manifest.json").exists() else None
        if problem:
            raise BadInput(f"checkpoint '{p}' is damaged ({problem}); name an older one")
        return p, "as given"
    for candidate in (p, p / "checkpoints"):
        if not candidate.is_dir():
            continue
        manager = CheckpointManager(candidate)
        newest = manager.latest_valid()
        if newest is None:
            continue
        if which == "latest":
            return newest, "the run's newest (--latest)"
        best, record = manager.best_valid(), manager.best()
        if best is not None:
            return best, (f"the run's best by real acceptance length: {record['score']:.3f} at step {record['step']}; "
                          "--latest for the newest")
        return newest, ("the run's newest: it kept no best" if record is None else
                        f"the run's newest: its best {record['checkpoint']} is unusable")
    raise BadInput(f"'{p}' holds no intact checkpoint; pass a run directory, its checkpoints/ directory or a "
                   "step-NNNNNNNN directory")


def resolve_checkpoint(path: str | os.PathLike, which: str = "latest") -> Path:
    """A step directory as it is; a checkpoints directory or a run directory: its newest intact checkpoint, or
    with `which="best"` the one with the best real acceptance length (`checkpoints/best`) where the run kept
    one, else the newest (`choose_checkpoint`)."""
    return choose_checkpoint(path, which)[0]


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16",
           which: str = "best") -> Path:
    """Export the checkpoint `checkpoint` names (see resolve_checkpoint: a run's best by default)."""
    src = resolve_checkpoint(checkpoint, which)
    out = Path(out)
    if out.is_symlink():  # dangling or not: the export is renamed into place, never written through a link
        raise BadInput(f"export target '{out}' is a symbolic link (to '{os.readlink(out)}'); choose a new directory, "
                       "or give the link's target itself")
    if out.exists() and not out.is_dir():
        raise BadInput(f"export target '{out}' exists and is not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"export target '{out}' exists and is not empty; choose a new directory")
    if dtype not in DTYPES:
        raise BadInput(f"export dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    try:
        drafter = Drafter.load(src).to(DTYPES[dtype])
    except Exception as exc:  # noqa: BLE001 - e.g. a truncated model.safetensors (SafetensorError)
        raise BadInput(f"checkpoint '{src}' could not be loaded as a drafter: {exc}") from None
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        drafter.save(tmp)
        meta = json.loads((tmp / "config.json").read_text())
        meta["dflash_exported_from"] = src.name
        meta["auto_map"] = auto_map_of(meta)
        meta["dtype"] = dtype  # transformers 5 name; `torch_dtype` (4.x) stays for older readers
        shutil.copyfile(MODELING_FILE, tmp / MODELING_FILE.name)
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        check_serving(tmp, out)  # nothing is renamed into place unless the engines' loaders can read it
        # readable by a serving engine running as another user, whatever the umask or the writer's mode
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_if_full(exc, out)
        raise
    return out


def check_serving(directory: str | os.PathLike, shown_as: str | os.PathLike | None = None) -> list:
    """The serving contract (dflash.models.serving_contract) on an exported directory: warnings logged and returned,
    errors one BadInput naming each rule and the engine file it comes from."""
    from dflash.models.serving_contract import check_export

    errors, warnings = check_export(directory)
    for w in warnings:  # the llama.cpp note holds for every export: `--check` prints it, an export does not
        if w.rule != "llama.cpp":
            log.warning(f"serving check, {shown_as or directory}: {w}")
    if errors:
        raise BadInput(f"serving check failed for {shown_as or directory}: " + "; ".join(map(str, errors)))
    return warnings


def init_source(path: str | os.PathLike) -> Path:
    """The directory `drafter.init_from` names: an export or a step directory as it is, a run's newest checkpoint."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"drafter.init_from '{p}' does not exist; point it at an exported drafter directory "
                       "(config.json + model.safetensors), a step-NNNNNNNN checkpoint or a run directory")
    try:
        return resolve_checkpoint(p)
    except BadInput as exc:
        raise BadInput(f"drafter.init_from: {exc}") from None


def init_arch(path: str | os.PathLike) -> tuple[Path, DrafterArch]:
    """`drafter.init_from`'s directory and architecture, from its config.json alone (no weights: read before any
    model loads, e.g. for the attention layout it trains with)."""
    src = init_source(path)
    try:
        cfg = json.loads((src / "config.json").read_text())
        return src, DrafterArch.from_hf_config(cfg, f"drafter config {src / 'config.json'}")
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise BadInput(f"drafter.init_from '{src}' could not be loaded as a drafter: {exc}") from None


def layout_text(layer_types: list[str] | None, sliding_window: int | None) -> str:
    """A drafter attention layout in a message: `all full_attention`, or its layer types and window."""
    sliding = bool(layer_types) and "sliding_attention" in layer_types
    if not sliding:
        return "all full_attention"
    return f"layer_types [{', '.join(layer_types)}] with sliding_window {sliding_window}"


def same_layout(a: tuple[list[str] | None, int | None], b: tuple[list[str] | None, int | None]) -> bool:
    """Two (layer_types, sliding_window) that attend alike: all-full spelt as a list or None is one layout."""
    def norm(layout):
        types, window = layout
        return (list(types), window) if types and "sliding_attention" in types else (None, None)

    return norm(a) == norm(b)


def check_init_layout(src: Path, arch: DrafterArch, layer_types: list[str] | None,
                      sliding_window: int | None) -> None:
    """drafter.layer_types / sliding_window, where the config sets them, must be the init's layout: the init's
    weights were trained with it, and it is what trains (one line naming both, else)."""
    if layer_types is None and sliding_window is None:
        return
    if not same_layout((layer_types, sliding_window), (arch.layer_types, arch.sliding_window)):
        raise BadInput(f"drafter.layer_types/sliding_window ({layout_text(layer_types, sliding_window)}) conflict with "
                       f"drafter.init_from '{src}' ({layout_text(arch.layer_types, arch.sliding_window)}); remove "
                       "drafter.layer_types and drafter.sliding_window from the config (the init's layout trains) or "
                       "set them to the init's")


def load_init_drafter(path: str | os.PathLike, expected: dict[str, tuple[str, object]]) -> Drafter:
    """`drafter.init_from`: an exported drafter, a checkpoint, a checkpoints or a run directory, as float32.

    `expected` maps a field of the drafter's architecture to (the config key it must agree with, its value);
    a difference is a BadInput naming both, e.g. "drafter.init_from 'X' has block_size 8 but
    drafter.block_size is 16".
    """
    src = init_source(path)
    try:
        drafter = Drafter.load(src)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise BadInput(f"drafter.init_from '{src}' could not be loaded as a drafter: {exc}") from None
    for field, (key, want) in expected.items():
        got = getattr(drafter.arch, field)
        if (list(got) if isinstance(got, list | tuple) else got) != want:
            fix = f"set {key.split(' (')[0]} to match the drafter" if key.startswith(("drafter.", "target.")) else (
                "start from a drafter trained for this target")
            raise BadInput(f"drafter.init_from '{src}' has {field} {got} but {key} is {want}; {fix}")
    return drafter.float()
