"""The trainer's checkpoint policy, called the way torchtitan's loop calls its checkpointer: which checkpoint a
start resumes from and which of its settings may change (the resume contract, docs/checkpoints.md), `load`,
`save` (finite weights only, by the reporter), the final save, and the best pointer. The files themselves are
dflash/components/checkpoint.py's (`CheckpointManager`: step directories, manifest, verify, recover, prune)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash.components.checkpoint import CheckpointManager, RNGState, check_contract, read_contract
from dflash.config import RESUME_CONTRACT_KEYS, RESUME_SHAPE_KEYS, RunConfig, default_gamma
from dflash.errors import BadInput, Diverged
from dflash.logs import get_logger
from dflash.runtime.stacks import resume_note

log = get_logger(__name__)

LAYOUT_KEYS = ("drafter.layer_types", "drafter.sliding_window")  # the attention layout in the resume contract


class Checkpointer:
    def __init__(self, config: RunConfig, directory: Path, is_reporter: bool):
        self.config = config
        self.is_reporter = is_reporter
        self.store = CheckpointManager(directory, config.checkpoint.keep_last)  # directories, until `attach`
        if is_reporter:
            self.store.recover()  # temp dirs of a killed save, a lagging `latest` pointer
        self.accepted_changes: dict[str, tuple[Any, Any]] = {}  # resume-contract changes the config allows
        self.layout: tuple[list[str] | None, int | None] | None = None
        self.observer = None  # the run's (events of saves and resumes), set by `attach`

    # ---------------------------------------------------------------------------------- before the models load
    def plan(self, layer_ids: list[int]) -> Path | None:
        """The checkpoint to resume from (None: step 0), checked before any model loads: a drafter.init_from
        whose layout conflicts with the config, damaged checkpoints and changed contract settings stop here."""
        self.layout = self._trained_layout()
        path = self._resume_candidate()
        self.accepted_changes = self._check_contract(path, layer_ids)
        if path is None and self.is_reporter:
            self.store.drop_best("a fresh start (checkpoint.resume=false)")
        return path

    def _resume_candidate(self) -> Path | None:
        """The newest intact checkpoint. Checkpoints that are all damaged stop the run (exit 2) instead of being
        overwritten by a fresh start; checkpoint.resume=false starts fresh on purpose."""
        if not self.config.checkpoint.resume:
            return None
        path = self.store.latest_valid()
        existing = self.store.list()
        if path is None and existing:
            problem = CheckpointManager.verify(existing[-1])
            raise BadInput(f"every checkpoint in '{self.store.dir}' is damaged ({len(existing)} found; newest "
                           f"{existing[-1].name}: {problem}); refusing to start over them from step 0. Restore "
                           "a good copy, or set checkpoint.resume=false to start fresh")
        return path

    def _trained_layout(self) -> tuple[list[str] | None, int | None]:
        """(layer_types, sliding_window) the drafter trains with: the config's; with drafter.init_from, the init's
        (read from its config.json), which a config that sets them must equal (else exit 2 naming both)."""
        d = self.config.drafter
        if not d.init_from:
            return d.layer_types, d.sliding_window
        from dflash.components.export import check_init_layout, init_arch, layout_text

        src, arch = init_arch(d.init_from)
        check_init_layout(src, arch, d.layer_types, d.sliding_window)
        if d.layer_types is not None or d.sliding_window is not None:
            return d.layer_types, d.sliding_window
        if arch.layer_types:
            log.info(f"drafter: the attention layout of drafter.init_from: {layout_text(arch.layer_types, arch.sliding_window)}")
        return arch.layer_types, arch.sliding_window

    def contract(self, layer_ids: list[int]) -> dict[str, Any]:
        """The settings that change the loss or the drafter's layout, as resolved for this run (config key ->
        value): recorded in every checkpoint, compared on resume. The layout is the one trained (the init's where
        drafter.init_from gives it)."""
        d = self.config.drafter
        contract: dict[str, Any] = {
            "drafter.block_size": d.block_size, "drafter.gamma": d.gamma or default_gamma(d.block_size),
            "drafter.num_anchors": d.num_anchors, "drafter.loss_impl": d.loss_impl,
            "drafter.num_layers": d.num_layers, "target.layer_ids": list(layer_ids)}
        layout = dict(zip(LAYOUT_KEYS, self.layout or (d.layer_types, d.sliding_window), strict=True))
        for key in RESUME_CONTRACT_KEYS:  # the optional layout settings (sliding window), where set
            section, name = key.split(".", 1)
            value = layout[key] if key in layout else getattr(getattr(self.config, section), name, None)
            if key not in contract and value is not None:
                contract[key] = value
        return contract

    def _check_contract(self, path: Path | None, layer_ids: list[int]) -> dict[str, tuple[Any, Any]]:
        """Refuse (exit 2) a resume whose config changed a contract setting, unless checkpoint.allow_changed
        accepts it; returns the accepted changes."""
        if path is None:
            return {}
        c = self.config
        notes = {} if c.drafter.gamma else {
            "drafter.gamma": f" (unset: the default for drafter.block_size {c.drafter.block_size})"}
        accepted = check_contract(path, self.contract(layer_ids), c.checkpoint.allow_changed, notes,
                                  fixed=list(RESUME_SHAPE_KEYS), proven=self._trained_layout_of(path))
        if "target.layer_ids" in accepted:
            old, new = accepted["target.layer_ids"]
            if len(old or []) != len(new):  # the fc layer takes one hidden state per tapped layer
                raise BadInput(f"target.layer_ids {new} taps {len(new)} layers but checkpoint {path} was trained "
                               f"on {len(old or [])} ({old}): its weights do not fit, whatever "
                               "checkpoint.allow_changed says; tap as many layers, or start a new output_dir")
        return accepted

    @staticmethod
    def _trained_layout_of(path: Path) -> dict[str, Any] | None:
        """The layout checkpoint `path`'s drafter config.json says it trained with, where its contract.json says
        otherwise (written by an earlier dflash, which recorded the config's layout over drafter.init_from's):
        the weights' own record wins, with a warning. None where they agree (or either is unreadable)."""
        from dflash.components.export import same_layout
        from dflash.models.drafter import layout_of_hf_config

        saved = read_contract(path)
        try:
            trained = layout_of_hf_config(json.loads((path / "config.json").read_text()), str(path))
        except (OSError, ValueError, BadInput):
            return None
        if saved is None or same_layout(tuple(saved.get(k) for k in LAYOUT_KEYS), trained):
            return None
        recorded = ", ".join(f"{k} {saved.get(k)}" for k in LAYOUT_KEYS)
        log.warning(f"checkpoint {path}: its contract.json records {recorded} but its drafter trained with "
                    f"layer_types {trained[0]}, sliding_window {trained[1]} (an earlier dflash recorded the config's "
                    "layout over drafter.init_from's); comparing with what it trained")
        return dict(zip(LAYOUT_KEYS, trained, strict=True))

    # ---------------------------------------------------------------------------------- the stateful parts
    def attach(self, trainer, layer_ids: list[int]) -> None:
        """What a checkpoint holds, restored in this order (the RNG last: loading draws from it)."""
        self.trainer = trainer
        self.observer = trainer.observer
        self.store.model = trainer.drafter
        self.store.states = {"optimizer": trainer.optimizer, "scheduler": trainer.scheduler,
                             "sampler": trainer.sampler, "rng": RNGState()}
        self.store.train_state = trainer
        self.store.contract = self.contract(layer_ids)

    def load(self, path: Path | None, previous_end: dict[str, Any] | None = None) -> bool:
        """Restore drafter, optimizer, scheduler, data position, RNG and step from `path` (chosen by `plan`); the
        resume line says how the previous start ended (`previous_end`, dflash/runtime/stacks.py) and the steps redone."""
        if path is None:
            return False
        self.store.load_state(path, accepted=list(self.accepted_changes))
        self._apply_optim_config()
        if self.accepted_changes:
            changed = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in self.accepted_changes.items())
            self.observer.event(f"resume: {changed} (changed since the checkpoint; accepted by "
                                "checkpoint.allow_changed)")
        self.observer.event(f"resumed from {path} at step {self.trainer.step}"
                            + resume_note(previous_end, self.trainer.step))
        return True

    def _apply_optim_config(self) -> None:
        """The config's lr/betas/eps/weight_decay win over the checkpoint's (one log line when they differ)."""
        o = self.config.optim
        optimizer, scheduler = self.trainer.optimizer, self.trainer.scheduler
        groups = optimizer.param_groups
        old = {"lr": scheduler.base_lrs[0], "betas": list(groups[0]["betas"]), "eps": groups[0]["eps"],
               "weight_decay": groups[0]["weight_decay"]}
        new = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        changed = [f"{k} {old[k]} -> {new[k]}" for k in new if old[k] != new[k]]
        scheduler.base_lrs = [o.lr for _ in groups]
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for g, lr in zip(groups, lrs, strict=True):
            g.update(lr=lr, initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                     capturable=False)  # a CUDA graph's (dflash/training/step_graph.py) is set again when it captures
        scheduler._last_lr = lrs
        if changed:
            self.observer.event(f"resume: optim {', '.join(changed)} (config differs from the checkpoint); "
                                "applying the config's values")

    # ---------------------------------------------------------------------------------- during the run
    def save(self, step: int, last_step: bool = False) -> Path | None:
        """A checkpoint of `step` (every rank checks the weights: DDP's are the same, and so is the answer; the
        reporter writes). `last_step`: only where the newest checkpoint is not this step's already."""
        if last_step and (step == 0 or self.store.path_for(step) in self.store.list()[-1:]):
            return None  # step 0: stopped before any step, nothing to keep
        finite = torch.stack([torch.isfinite(p).all() for p in self.trainer.drafter.parameters()]).all()
        if not bool(finite):  # one device sync, not one per parameter
            raise self.diverged(f"the drafter's weights are not finite after step {step}")
        if not self.is_reporter:
            return None
        path = self.store.save_state(step)
        self.observer.event(f"checkpoint: {path}")
        return path

    def diverged(self, what: str) -> Diverged:
        """Training diverged (docs/troubleshooting.md): no checkpoint is written with these weights."""
        saved = self.store.list()
        return Diverged(f"training diverged: {what}; lower optim.lr (it is {self.config.optim.lr:g}) or check the "
                        f"data; no checkpoint was written with these weights (the last one: "
                        f"{saved[-1] if saved else 'none'})")

    def keep_if_best(self, step: int, record: dict[str, Any] | None) -> None:
        """The checkpoint with the best real acceptance length so far becomes `checkpoints/best` (never pruned).
        An eval at a step without a checkpoint saves one first, only when it is a new best. A record that is not
        lossless is never the best (the evaluator raises on one: `EvalNotLossless`)."""
        score = (record or {}).get("acceptance_length")
        if score is None or record.get("lossless") is False or not self.store.beats_best(score):
            return
        if not self.store.path_for(step).is_dir():
            self.save(step)
        if self.store.keep_if_best(step, score):
            self.observer.event(f"best checkpoint: {self.store.path_for(step).name} (acceptance length {score:.3f})")
