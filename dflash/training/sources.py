"""Where the trainer's micro-batches and their target features come from (its input source): the protocol, and
`LocalTarget`, the target in this process (single process, colocated ranks). A disaggregated drafter rank's source
is `dflash.training.ranks.RemoteTargets` (features sent by target ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dflash.config import RunConfig
from dflash.data.buckets import Batch
from dflash.evaluation.evaluate import TargetFeatures
from dflash.logs import get_logger
from dflash.models.target import Target, build_hf_model, require_fast_path

log = get_logger(__name__)


class InputSource(Protocol):
    """Where the trainer's micro-batches and their target features come from. Its `target`, `features`,
    `embed_tokens` and `lm_head_weight` are also what the evaluator reads (`dflash.evaluation.evaluate.FeatureSource`)."""

    target: Target | None  # the target in this process (evaluation needs it), or None

    def open(self, config: RunConfig, layer_ids: list[int], device: torch.device) -> Target | None:
        """At setup, before the data is built (regeneration needs the target): load what this process holds."""

    def connect(self, trainer: Any) -> None:
        """After the drafter is built and resumed: the data position and the schedule are known (the `Trainer`:
        its config, inputs, sampler and device)."""

    def next(self) -> tuple[int, Batch, torch.Tensor]:
        """(epoch, batch on the device, target features) of this rank's next micro-batch."""

    def features(self, batch: Batch) -> torch.Tensor: ...

    def embed_tokens(self) -> torch.nn.Embedding: ...

    def lm_head_weight(self) -> torch.Tensor: ...

    def finish(self) -> None:
        """After the last step."""


class LocalTarget(TargetFeatures):
    """The target in this process (single process, colocated ranks): features of the rank's own batches (its
    features, embedding and LM head as an evaluation reads them: `TargetFeatures`)."""

    def __init__(self) -> None:
        super().__init__(None)  # loaded by `open`

    def open(self, config: RunConfig, layer_ids: list[int], device: torch.device) -> Target:
        c = config
        model = build_hf_model(c.target.path, c.target.random_init, c.target.dtype, c.target.attn_implementation,
                               seed=c.seed, device=device)
        target = Target(model.to(device), layer_ids)
        report = target.fast_path_report()
        log.info(f"target: {target.num_layers} layers, hidden {target.hidden_size}, tapped {layer_ids}; "
                 f"{report.describe()}")
        require_fast_path(report, device, c.target.allow_slow_path)
        self.target = target
        return target

    def connect(self, trainer: Any) -> None:
        self.inputs, self.sampler, self.device = trainer.inputs, trainer.sampler, trainer.device
        c = trainer.config
        self.cache = None
        if c.data.feature_cache:
            from dflash.data.feature_cache import FeatureCache

            t = c.target
            identity = {"target": t.path, "random_init": t.random_init, "seed": c.seed, "dtype": t.dtype,
                        "float8": t.float8, "layer_ids": self.inputs.layer_ids}
            self.cache = FeatureCache(Path(c.output_dir) / "feature-cache", identity, c.data.feature_cache_dtype,
                                      next(self.target.model.parameters()).dtype)

    def features(self, batch: Batch) -> torch.Tensor:
        cache = getattr(self, "cache", None)
        if cache is None:
            return super().features(batch)
        return cache.features(batch, super().features)

    def next(self) -> tuple[int, Batch, torch.Tensor]:
        epoch, blen, idx = self.sampler.next()
        batch = self.inputs.batch(blen, idx).to(self.device)
        return epoch, batch, self.features(batch)

    def finish(self) -> None:
        if getattr(self, "cache", None) is not None:
            log.info(self.cache.describe())
