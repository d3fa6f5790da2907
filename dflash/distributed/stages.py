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
"""

from __future__ import annotations

import signal
from datetime import timedelta

import torch
from torch import nn

from dflash.config import RunConfig
from dflash.data.buckets import collate
from dflash.distributed.topology import RankPlan
from dflash.distributed.transfer import FeatureConsumer, FeatureProducer, ItemSchedule, TransferLayout
from dflash.errors import BadInput
from dflash.models.target import _find_layers, _StopForward, _text_config, build_hf_model, kernels_importable


def stage_bounds(deepest_layer: int, stages: int) -> list[tuple[int, int]]:
    """Split layers 0..deepest_layer into `stages` contiguous ranges [start, stop) of near-equal size (the
    later stages take the remainder: stage 0 also runs the embedding)."""
    n = deepest_layer + 1
    if not 1 <= stages <= n:
        raise BadInput(f"topology.target_stages={stages}: the target runs {n} layers (up to the deepest tapped "
                       f"layer {deepest_layer}), so use 1..{n} stages")
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
        text_config = _text_config(model.config)
        self.hidden_size = int(text_config.hidden_size)
        name, layers = _find_layers(model, int(text_config.num_hidden_layers))
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
        for i in self.tapped:
            kept[i - start].register_forward_hook(self._hook(i, stop_after=False))
        kept[len(kept) - 1].register_forward_hook(self._hook(stop - 1, stop_after=True))

    def _hook(self, index: int, stop_after: bool):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if stop_after:
                self._captured[-1] = hidden
                raise _StopForward
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
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                hidden_in: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self._captured.clear()
        try:
            if self.first:
                self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            else:
                self.backbone(inputs_embeds=hidden_in, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        out = self._captured.pop(-1)  # a tapped last layer was captured by its own hook too
        taps = [self._captured[i] for i in self.tapped]
        self._captured.clear()
        return out, taps


def _drop_attribute_holding(owner: nn.Module, module: nn.Module | None) -> None:
    """Free a submodule this stage does not need (the embedding or LM head), wherever `owner` keeps it."""
    if module is None:
        return
    for parent in owner.modules():
        for key, child in list(parent.named_children()):
            if child is module:
                setattr(parent, key, None)


def run_target_stage(config: RunConfig, plan: RankPlan, rank: int, device: torch.device, head_group,
                     dtype: torch.dtype, timeout: timedelta) -> None:
    """One stage of a layer-split target replica (topology.target_stages > 1)."""
    from dflash.distributed.ranks import _broadcast_object, check_fault, drafter_samplers, share_frozen_head
    from dflash.train import Trainer, check_token_range

    signal.signal(signal.SIGTERM, lambda *_: None)  # the drafter ranks decide when to stop (STOP credits)
    signal.signal(signal.SIGINT, lambda *_: None)
    c = config
    stages = plan.target_stages
    replica, stage = plan.replica_of(rank), plan.stage_of(rank)
    chain = plan.replica_ranks(replica)
    trainer = Trainer(c, is_reporter=False, device=device).setup(with_target=False, with_drafter=False)
    bounds = stage_bounds(max(trainer.layer_ids), stages)
    start, stop = bounds[stage]
    # built on the CPU, then only this stage's layers move to the GPU; a random init is thus the same as
    # an unsplit target's on the CPU, and a checkpoint is read once per stage
    model = build_hf_model(c.target.path, c.target.random_init, c.target.dtype, c.target.attn_implementation,
                           seed=c.seed, device="cpu")
    part = TargetStage(model, trainer.layer_ids, start, stop, keep_embedding=stage == 0,
                       keep_head=rank == plan.target_ranks[0]).to(device)
    del model
    if stage == 0:
        check_token_range(trainer.train_set, part.embed_tokens.weight.shape[0])
    linear = sum(1 for m in part.modules() if "GatedDeltaNet" in type(m).__name__)
    if linear and device.type == "cuda" and not all(kernels_importable()) and not c.target.allow_slow_path:
        raise BadInput(f"target stage {stage}: {linear} GatedDeltaNet layers would run on the slow PyTorch path; "
                       "install flash-linear-attention and causal-conv1d or set target.allow_slow_path=true")
    hidden = part.hidden_size
    info = _broadcast_object(None, plan.reporter)
    if rank == plan.target_ranks[0]:
        share_frozen_head(part, head_group, rank, rank, device, dtype)
    accum, drafters = c.optim.grad_accum, len(plan.drafter_ranks)
    schedule = ItemSchedule(plan.producers, plan.drafter_ranks, info["step"] * accum,
                            (info["total_steps"] - info["step"]) * accum)
    mine = [(d, n) for d, n, producer in schedule.items() if producer == chain[-1]]
    inflight = c.topology.max_inflight

    def link_layout(s: int) -> TransferLayout:  # stage s -> s + 1: hidden + the taps of layers < stop_s
        taps = sum(1 for i in trainer.layer_ids if i < bounds[s][1])
        return TransferLayout.for_config(c.data.token_budget, c.data.bucket_size, c.data.max_length,
                                         (1 + taps) * hidden, dtype)

    def link(s: int) -> ItemSchedule:
        return ItemSchedule((chain[s],), (chain[s + 1],), 0, len(mine))

    up = (FeatureConsumer(link(stage - 1), 0, link_layout(stage - 1), inflight, device, timeout)
          if stage > 0 else None)
    last = stage == stages - 1
    if last:
        down = FeatureProducer(schedule, rank, TransferLayout.for_config(
            c.data.token_budget, c.data.bucket_size, c.data.max_length, len(trainer.layer_ids) * hidden, dtype),
            inflight, device, timeout)
    else:
        down = FeatureProducer(link(stage), rank, link_layout(stage), inflight, device, timeout)
    print(f"{plan.describe(rank)}: layers {start}..{stop - 1} of replica {replica}, {len(mine)} micro-batches "
          f"from step {info['step']}", flush=True)

    if stage == 0:
        pad = trainer.tokenizer.pad_token_id or 0
        samplers = drafter_samplers(c, trainer.train_set, drafters, info["sampler"])

        def inputs():
            for d, n, producer in schedule.items():
                epoch, blen, idx = samplers[d].next()
                if producer == chain[-1]:
                    yield d, n, epoch, collate(trainer.train_set.samples, idx, blen, pad).to(device), None
    else:
        def inputs():
            for d, n in mine:
                epoch, batch, features = up.receive()
                yield d, n, epoch, batch, features

    for k, (d, n, epoch, batch, features) in enumerate(inputs()):
        check_fault(rank, info["step"] + n // accum)
        hidden_in = features[..., :hidden] if features is not None else None
        out, taps = part(batch.input_ids, batch.attention_mask, hidden_in)
        earlier = [features[..., hidden:]] if features is not None and features.shape[-1] > hidden else []
        if last:
            payload, item, dst = torch.cat([*earlier, *taps], dim=-1), n, d
        else:
            payload, item, dst = torch.cat([out, *earlier, *taps], dim=-1), k, 0
        if not down.wants(dst, item):
            break
        down.send(dst, item, epoch, batch, payload)
    down.finish()
    if up is not None:
        up.finish()
    print(f"{plan.describe(rank)}: sent {down.sent} micro-batches", flush=True)
