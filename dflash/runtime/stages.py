"""A target split by layers across several target ranks (`topology.target_stages`), disaggregated mode.

Only layers 0..deepest tapped layer are ever needed (the forward stops there), so those are what the
stages share: stage s of a replica holds a contiguous range of them, stage 0 also the embedding, and the
first target rank also the LM head (it broadcasts embedding and head to the drafter ranks). A micro-batch
goes through the replica's stages in order over the same fixed-buffer, credit-based transfers that feed
the drafter ranks (`transfer.py`):

* stage s -> s+1: the hidden state after stage s's last layer, followed by the tapped states captured so
  far (features = [hidden | taps...]), plus tokens and meta, so every stage rebuilds the batch;
* last stage -> drafter ranks: the tapped states of all tapped layers, exactly as an unsplit target rank
  sends them.

Stage s runs the backbone's own forward (rotary embeddings, causal and linear-attention masks) over its
layer range: stage 0 from the token ids, later stages from `inputs_embeds` = the incoming hidden state.
An unsplit target rank is stage 0 of 1 (`ranks.run_target_rank` is the one loop of every target rank).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.errors import BadInput
from dflash.models.families import family_of, text_config_of
from dflash.models.target import FastPathReport, StopForward, fast_path_report, feature_depth, find_layers


def stage_bounds(layer_ids: list[int], stages: int) -> list[tuple[int, int]]:
    """Split the layers the feature forward runs (0 .. the deepest of `layer_ids`: `feature_depth`) into `stages`
    contiguous ranges [start, stop) of near-equal size (the later stages take the remainder: stage 0 also runs
    the embedding)."""
    n = feature_depth(layer_ids)
    if not 1 <= stages <= n:
        raise BadInput(f"topology.target_stages={stages}: the target runs {n} layers (up to the deepest tapped "
                       f"layer {n - 1}), so use 1..{n} stages")
    base, extra = divmod(n, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class TargetStage(nn.Module):
    """Layers [start, stop) of a Hugging Face causal LM; `forward` returns (hidden after `stop - 1`, taps)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], start: int, stop: int, keep_embedding: bool,
                 keep_head: bool):
        super().__init__()
        text_config = text_config_of(model.config)
        self.hidden_size = int(text_config.hidden_size)
        name, layers = find_layers(model)
        self.eager_mixers = family_of(model.config).eager_modules  # kept eager when its layers compile
        owner, _, leaf = name.rpartition(".")
        self.backbone = model.get_submodule(owner) if owner else model
        setattr(self.backbone, leaf, nn.ModuleList(list(layers)[start:stop]))  # the other layers are freed
        # backbones that pick each layer's mask by loop index (config.layer_types[i]) see the stage's slice
        types = getattr(text_config, "layer_types", None)
        if isinstance(types, (list, tuple)) and len(types) == len(layers):
            text_config.layer_types = list(types)[start:stop]
        self.start, self.stop, self.first = start, stop, start == 0
        self.tapped = [i for i in sorted(layer_ids) if start <= i < stop]
        self._embed = model.get_input_embeddings() if keep_embedding or keep_head else None
        self._head = model.get_output_embeddings() if keep_head else None
        if not (keep_embedding or keep_head):
            _drop_attribute_holding(self.backbone, model.get_input_embeddings())
        if not keep_head:
            _drop_attribute_holding(model, model.get_output_embeddings())
        self.model = model.eval().requires_grad_(False)
        self._captured: dict[int, torch.Tensor] = {}
        kept = getattr(self.backbone, leaf)
        self.layers = kept  # what `dflash.compile.compile_target_layers` compiles
        self.num_layers = int(text_config.num_hidden_layers)
        for i in self.tapped:
            kept[i - start].register_forward_hook(self._hook(i, stop_after=False))
        kept[len(kept) - 1].register_forward_hook(self._hook(stop - 1, stop_after=True))

    def _hook(self, index: int, stop_after: bool):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if stop_after:
                self._captured[-1] = hidden
                raise StopForward
            self._captured[index] = hidden

        return hook

    @property
    def embed_tokens(self) -> nn.Embedding:
        if self._embed is None:
            raise RuntimeError("this target stage holds no embedding")
        return self._embed

    @property
    def lm_head(self) -> nn.Linear:
        if self._head is None:
            raise RuntimeError("this target stage holds no LM head")
        return self._head

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 hidden_in: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self._captured.clear()
        try:
            if self.first:
                self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            else:
                self.backbone(inputs_embeds=hidden_in, attention_mask=attention_mask, use_cache=False)
        except StopForward:
            pass
        out = self._captured.pop(-1)  # a tapped last layer was captured by its own hook too
        taps = [self._captured[i] for i in self.tapped]
        self._captured.clear()
        return out, taps

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                hidden_in: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.features(input_ids, attention_mask, hidden_in)

    def fast_path_report(self) -> FastPathReport:
        """As `Target.fast_path_report`, for this stage's layers (probed with a forward of its own input)."""
        device = next(self.parameters()).device

        def probe() -> None:
            if self.first:
                self.features(torch.randint(0, self.embed_tokens.weight.shape[0], (1, 64), device=device), None)
            else:
                dtype = next(self.parameters()).dtype
                self.features(None, None, torch.zeros(1, 64, self.hidden_size, device=device, dtype=dtype))

        return fast_path_report(self.model, self.num_layers, probe)


def _drop_attribute_holding(owner: nn.Module, module: nn.Module | None) -> None:
    """Free a submodule this stage does not need (the embedding or LM head), wherever `owner` keeps it."""
    if module is None:
        return
    for parent in owner.modules():
        for key, child in list(parent.named_children()):
            if child is module:
                setattr(parent, key, None)
