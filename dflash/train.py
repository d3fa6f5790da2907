"""The training loop: target features -> anchors/blocks -> drafter -> decayed CE -> AdamW step.

Read top to bottom: `Trainer.setup()` builds every component, `Trainer.run()` loops over `train_step()`.
Distributed topologies (dflash.distributed) reuse these pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.checkpoint import CheckpointManager, ensure_writable, load_trainer_state, save_trainer_state
from dflash.compile import compile_drafter, compile_target_layers, configure_for_run
from dflash.config import RunConfig, default_gamma, resolved_layer_ids
from dflash.data.buckets import Batch, RoundRobinBatchSampler, collate
from dflash.data.chat import TokenizedSet, load_tokenized, tokenize_conversations
from dflash.errors import BadInput, DataError
from dflash.flops import drafter_step_flops, peak_flops
from dflash.loss import BlockStats, build_blocks, position_weights, sample_anchors, weighted_block_loss
from dflash.models.attention import compiled_flex_attention, resolve_kind
from dflash.models.drafter import Drafter, arch_from_target
from dflash.models.target import Target, build_hf_model, num_layers_of
from dflash.notify import Notifier
from dflash.observability import RunObserver

log = logging.getLogger(__name__)


def pick_device(requested: str, setting: str = "runtime.device") -> torch.device:
    """cpu, or this rank's GPU (LOCAL_RANK); `setting` names the option in the error."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInput(f"{setting} is 'cuda' but no CUDA GPU is visible; check CUDA_VISIBLE_DEVICES "
                           f"or set {setting} cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def load_tokenizer(config: RunConfig):
    if config.tokenizer.synthetic_vocab_size is not None:
        from dflash.data.synthetic import build_tokenizer

        return build_tokenizer(config.tokenizer.synthetic_vocab_size)
    path = config.tokenizer.path or config.target.path
    if path is None:
        raise BadInput("tokenizer: set tokenizer.path (a local tokenizer directory) or "
                       "tokenizer.synthetic_vocab_size (random-weight targets have no tokenizer of their own)")
    return load_tokenizer_dir(path)


def load_tokenizer_dir(path: str):
    """A local tokenizer directory with a chat template (data and prompts are rendered with it)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadInput(f"tokenizer '{path}' could not be loaded: {exc}") from None
    if not getattr(tok, "chat_template", None):
        raise BadInput(f"tokenizer '{path}' has no chat template; training data and prompts are rendered with it")
    return tok


def load_datasets(config: RunConfig, tokenizer, target: Target | None = None, need_train: bool = True
                  ) -> tuple[TokenizedSet | None, TokenizedSet | None]:
    """Train and held-out sets; with data.regenerate, their assistant turns are the target's own answers.

    need_train=False (evaluation): only the held-out set is built; the first element is None."""
    d = config.data
    if d.regenerate is not None and target is None:
        raise BadInput("data.regenerate needs the target in this process (colocated ranks); regenerate the data "
                       "with `dflash regenerate` and set data.train_path instead")
    train = evalset = None
    if d.synthetic is not None:
        from dflash.data.synthetic import generate_conversations

        vocab_words = config.tokenizer.synthetic_vocab_size or 64
        s = d.synthetic
        convs = [row["messages"] for row in
                 generate_conversations(s.num_samples, vocab_words, s.min_length, s.max_length, s.strides, s.seed)]
        n_eval = int(len(convs) * d.eval_fraction)
        splits = {"synthetic": convs[n_eval:] if need_train else [], "synthetic-eval": convs[:n_eval]}
        for name, conversations in splits.items():
            if not conversations:
                continue
            if d.regenerate is not None:
                conversations, _ = regenerated(config, name, conversations, tokenizer, target)
            tokenized = tokenize_conversations(tokenizer, conversations, d.max_length, d.min_loss_tokens, name)
            if name == "synthetic":
                train = tokenized
            else:
                evalset = tokenized
    else:
        cache = d.cache_dir or str(Path(config.output_dir) / ".token-cache")

        def load(path: str) -> TokenizedSet:
            if d.regenerate is not None:
                from dflash.data.chat import read_jsonl

                _, regen = regenerated(config, path, read_jsonl(path), tokenizer, target)
                path = str(regen)
            return load_tokenized(path, tokenizer, d.max_length, d.min_loss_tokens, cache)

        train = load(d.train_path) if need_train else None
        evalset = load(d.eval_path) if d.eval_path else None
    if train is not None and len(train) == 0:
        raise DataError(f"no training sample has at least data.min_loss_tokens={d.min_loss_tokens} assistant "
                        f"tokens ({train.dropped_few_loss_tokens} dropped); lower data.min_loss_tokens or check "
                        "that the data has assistant turns")
    return train, evalset


def _regen_path(config: RunConfig, name: str, conversations, tokenizer) -> Path:
    """A file under output_dir/regenerated/ keyed by everything that decides the answers."""
    import hashlib
    import json

    from dflash.data.chat import tokenizer_fingerprint

    key = json.dumps([config.target.path, config.target.random_init, config.target.dtype, config.seed,
                      dataclasses.asdict(config.data.regenerate), tokenizer_fingerprint(tokenizer),
                      conversations], sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(config.output_dir) / "regenerated" / f"{Path(name).stem}-{digest}.jsonl"


def regenerated(config: RunConfig, name: str, conversations, tokenizer, target: Target) -> tuple[list, Path]:
    """The conversations with every assistant turn answered by the target, and the JSONL file that holds them
    under output_dir/regenerated/ (reused across restarts while target, tokenizer, settings and prompts match)."""
    from dflash.data.chat import read_jsonl
    from dflash.data.synthetic import write_jsonl

    if len(tokenizer) > target.vocab_size:
        raise BadInput(f"token ids up to {len(tokenizer) - 1} (the tokenizer's) are outside the target's embedding "
                       f"table ({target.vocab_size}); the tokenizer does not belong to this target")
    path = _regen_path(config, name, conversations, tokenizer)
    if path.is_file():
        return read_jsonl(path), path
    from dflash.regenerate import SamplingParams, TransformersBackend, regenerate_conversations

    r = config.data.regenerate
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            seed=config.seed, thinking=r.thinking)
    t0 = time.time()
    backend = TransformersBackend(target.model, tokenizer, batch_size=r.batch_size)
    with target.capture_all():  # the whole forward (the tapping hooks must not stop it)
        out, stats = regenerate_conversations(conversations, backend, params)
    kept = [conv for conv in out if conv is not None]
    if not kept:
        raise DataError(f"regeneration of {name} produced no conversation (all prompts skipped as too long?)")
    write_jsonl(path, [{"messages": conv} for conv in kept])
    log.info("regenerated %s: %s", name, stats.to_dict())
    print(f"regenerated {len(kept)} {name} answers with the target in {time.time() - t0:.1f}s -> {path}", flush=True)
    return kept, path


def cosine_schedule(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def check_token_range(dataset: TokenizedSet, vocab_size: int) -> None:
    max_id = max((int(ids.max()) for ids, _ in dataset.samples if ids.numel()), default=-1)
    if max_id >= vocab_size:
        raise BadInput(f"token id {max_id} is outside the target's embedding table ({vocab_size}); the "
                       "tokenizer does not belong to this target")


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """Anchors depend only on (seed, step, rank): a resumed run draws exactly what an unbroken one would."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)


def _python_rng_state() -> list:
    version, internal, gauss_next = random.getstate()
    return [version, list(internal), gauss_next]


def _set_python_rng_state(state) -> None:
    """From `_python_rng_state()` or an older checkpoint's `random.getstate()` tuple."""
    version, internal, gauss_next = state
    random.setstate((int(version), tuple(int(x) for x in internal), gauss_next))


@dataclass
class StepResult:
    loss: float
    stats: BlockStats
    tokens: int


class Trainer:
    def __init__(self, config: RunConfig, rank: int = 0, world_size: int = 1, is_reporter: bool = True,
                 device: torch.device | None = None):
        self.config = config
        self.rank, self.world_size = rank, world_size  # position among the data-parallel drafter ranks
        self._device = device  # set by dflash.distributed (the rank's GPU); else runtime.device
        self.is_reporter = is_reporter
        self.step = 0
        self.input_seconds = 0.0  # time in next_input() since the last report window
        self.stop_requested = False
        self.ddp_model = None  # set by dflash.distributed for data-parallel drafter ranks
        self.last_eval: dict[str, Any] | None = None  # the last eval record (heartbeat, status)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, with_target: bool = True, with_drafter: bool = True) -> Trainer:
        """with_target=False: disaggregated drafter rank; with_drafter=False: disaggregated target rank.

        A failure here (bad data, a tokenizer that does not fit the target, damaged checkpoints) leaves the
        heartbeat at status `failed` with the reason in `error`, never `starting`, and removes the checkpoints
        directory again when this setup created it and nothing was saved."""
        ckpt_dir = Path(self.config.output_dir) / "checkpoints"
        created = not ckpt_dir.exists()
        try:
            return self._setup(with_target, with_drafter)
        except Exception as exc:
            observer = getattr(self, "observer", None)
            if observer is not None:
                reason = str(exc) if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"
                observer.heartbeat(self.step, 0, "failed", error=reason.splitlines()[0] if reason else type(exc).__name__)
            if created and self.is_reporter:
                with contextlib.suppress(OSError):
                    ckpt_dir.rmdir()  # only when empty
            raise

    def _setup(self, with_target: bool, with_drafter: bool) -> Trainer:
        c = self.config
        if c.runtime.num_threads:
            torch.set_num_threads(c.runtime.num_threads)
        out = Path(c.output_dir)
        self.ckpt = CheckpointManager(ensure_writable(out / "checkpoints"), c.checkpoint.keep_last)
        if with_drafter and self.is_reporter:
            self.ckpt.recover()  # temp dirs of a killed save, a lagging `latest` pointer
        self.layer_ids = resolved_layer_ids(c, num_layers_of(c.target.path, c.target.random_init))
        self.device = self._device or pick_device(c.runtime.device)
        self.observer = RunObserver(out, c.logging.tensorboard, enabled=self.is_reporter)
        self.observer.heartbeat(0, 0, "starting")
        self.compile_plan, compile_line = configure_for_run(c.compile, c.output_dir, self.device)
        self.observer.event(compile_line)
        if with_drafter:
            self._resume_from = self._resume_candidate()  # before any model loads: damaged ones stop us here
        self.tokenizer = load_tokenizer(c)
        self.target = self._load_target() if with_target else None
        self.train_set, self.eval_set = load_datasets(c, self.tokenizer, self.target)
        if self.target is not None and self.compile_plan.target:  # after regeneration: it decodes eagerly
            compile_target_layers(self.target, self.compile_plan.target_mode)
        if self.target is not None:
            check_token_range(self.train_set, self.target.vocab_size)
        self.observer.event(f"data: {len(self.train_set)} training samples ({self.train_set.dropped_few_loss_tokens} "
                            f"dropped with < {c.data.min_loss_tokens} loss tokens, {self.train_set.truncated} "
                            f"truncated to {c.data.max_length}); eval: {len(self.eval_set) if self.eval_set else 0}")
        self.sampler = RoundRobinBatchSampler(self.train_set.lengths(), c.data.token_budget, c.data.bucket_size,
                                              c.data.max_length, seed=c.seed, rank=self.rank,
                                              world_size=self.world_size, multiple_of=c.optim.grad_accum)
        per_epoch = self.sampler.batches_per_epoch() // c.optim.grad_accum
        if per_epoch == 0:
            raise DataError("the training data yields no batch; add samples or lower the number of ranks "
                            "or optim.grad_accum")
        self.total_steps = c.optim.max_steps or per_epoch * c.optim.epochs
        if with_drafter:
            self._build_drafter()
            self._build_optimizer()
            self.resume()
        return self

    def _load_target(self) -> Target:
        c = self.config
        model = build_hf_model(c.target.path, c.target.random_init, c.target.dtype, c.target.attn_implementation,
                               seed=c.seed, device=self.device)
        target = Target(model.to(self.device), self.layer_ids)
        report = target.fast_path_report()
        self.observer.event(f"target: {target.num_layers} layers, hidden {target.hidden_size}, tapped "
                            f"{self.layer_ids}; {report.describe()}")
        if self.device.type == "cuda" and not report.fast and not c.target.allow_slow_path:
            raise BadInput("the hybrid target would run on the slow PyTorch path (" + report.describe() + "); "
                           "install flash-linear-attention and causal-conv1d (the `kernels` role, or "
                           "`pip install dflash-trainer[gpu]` + a causal-conv1d build) or set "
                           "target.allow_slow_path=true")
        return target

    def _mask_token_id(self, vocab_size: int) -> int:
        c = self.config.drafter
        mid = c.mask_token_id
        if mid is None:
            mid = getattr(self.tokenizer, "mask_token_id", None)
        if mid is None:
            mid = self.tokenizer.pad_token_id
        if mid is None or not 0 <= mid < vocab_size:
            raise BadInput(f"drafter.mask_token_id {mid} is not a token of the target's vocabulary (0..{vocab_size - 1}); "
                           "set drafter.mask_token_id to a reserved token id")
        return int(mid)

    def _build_drafter(self) -> None:
        c = self.config
        from dflash.models.target import target_config

        tcfg = target_config(c.target.path, c.target.random_init)
        text_cfg = getattr(tcfg, "text_config", None) or tcfg
        vocab = self.target.vocab_size if self.target is not None else text_cfg.vocab_size
        if c.drafter.init_from:  # must agree with this config: what it trains is the config's drafter
            from dflash.export import load_init_drafter

            mask_key = "drafter.mask_token_id" if c.drafter.mask_token_id is not None else (
                "drafter.mask_token_id (unset: the tokenizer's mask or pad token)")
            expected = {"block_size": ("drafter.block_size", c.drafter.block_size),
                        "num_hidden_layers": ("drafter.num_layers", c.drafter.num_layers),
                        "target_layer_ids": ("target.layer_ids (resolved)", list(self.layer_ids)),
                        "mask_token_id": (mask_key, self._mask_token_id(vocab)),
                        "hidden_size": ("the target's hidden_size", int(text_cfg.hidden_size))}
            for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads"):  # when set
                if getattr(c.drafter, key) is not None:
                    expected[key] = (f"drafter.{key}", getattr(c.drafter, key))
            self.drafter = load_init_drafter(c.drafter.init_from, expected)
        else:
            arch = arch_from_target(tcfg, num_layers=c.drafter.num_layers, block_size=c.drafter.block_size,
                                    layer_ids=self.layer_ids, mask_token_id=self._mask_token_id(vocab),
                                    vocab_size=vocab, intermediate_size=c.drafter.intermediate_size,
                                    num_attention_heads=c.drafter.num_attention_heads,
                                    num_key_value_heads=c.drafter.num_key_value_heads)
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(c.seed + 17)
            self.drafter = Drafter(arch)
            torch.random.set_rng_state(gen_state)
        self.drafter.to(self.device)
        self.gamma = c.drafter.gamma or default_gamma(c.drafter.block_size)
        self.attention_kind = resolve_kind(c.drafter.attention, self.device)
        plan = self.compile_plan
        self._flex = compiled_flex_attention(plan.drafter_mode) if (self.attention_kind == "flex" and plan.flex) else None
        if plan.drafter:  # the whole forward (measured faster than per layer); the BlockMask stays eager
            compile_drafter(self.drafter, plan.drafter_mode)

    def _build_optimizer(self) -> None:
        o = self.config.optim
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_schedule(self.total_steps, o.warmup_ratio, o.min_lr_ratio))

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            # plain lists: trainer_state.pt loads with weights_only=True
            "rng": {"torch": torch.random.get_rng_state(), "python": _python_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self) -> Path | None:
        if not self.is_reporter:
            return None
        state = self.state_dict()

        def write(tmp: Path) -> None:
            self.drafter.save(tmp)
            save_trainer_state(tmp, state)

        path = self.ckpt.save(self.step, write)
        self.observer.event(f"checkpoint: {path}")
        return path

    def _resume_candidate(self) -> Path | None:
        """The newest intact checkpoint to resume from (None: start at step 0).

        Checkpoints that are all damaged stop the run (exit 2) instead of being overwritten by a fresh start;
        checkpoint.resume=false starts fresh on purpose."""
        if not self.config.checkpoint.resume:
            return None
        path = self.ckpt.latest_valid()
        existing = self.ckpt.list()
        if path is None and existing:
            problem = CheckpointManager.verify(existing[-1])
            raise BadInput(f"every checkpoint in '{self.ckpt.dir}' is damaged ({len(existing)} found; newest "
                           f"{existing[-1].name}: {problem}); refusing to start over them from step 0. Restore "
                           "a good copy, or set checkpoint.resume=false to start fresh")
        return path

    def _check_same_drafter(self, loaded: Drafter, path: Path) -> None:
        """A checkpoint of a differently shaped drafter cannot be resumed: name the config key."""
        keys = {"num_hidden_layers": "drafter.num_layers", "block_size": "drafter.block_size",
                "target_layer_ids": "target.layer_ids", "mask_token_id": "drafter.mask_token_id",
                "intermediate_size": "drafter.intermediate_size",
                "num_attention_heads": "drafter.num_attention_heads",
                "num_key_value_heads": "drafter.num_key_value_heads", "hidden_size": "the target's hidden_size",
                "head_dim": "the target's head_dim", "vocab_size": "the target's vocab_size"}
        for field_name, key in keys.items():
            old, new = getattr(loaded.arch, field_name), getattr(self.drafter.arch, field_name)
            if (list(old) if isinstance(old, list | tuple) else old) != (
                    list(new) if isinstance(new, list | tuple) else new):
                raise BadInput(f"{key} is {new} but the checkpoint {path} was trained with {old}; a changed "
                               f"drafter cannot resume: use a new output_dir (or set {key.split(' (')[0]} back)")

    def _apply_optim_config(self) -> None:
        """The config's lr/betas/eps/weight_decay win over the checkpoint's (one log line when they differ)."""
        o = self.config.optim
        groups = self.optimizer.param_groups
        old = {"lr": self.scheduler.base_lrs[0], "betas": list(groups[0]["betas"]), "eps": groups[0]["eps"],
               "weight_decay": groups[0]["weight_decay"]}
        new = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        changed = [f"{k} {old[k]} -> {new[k]}" for k in new if old[k] != new[k]]
        self.scheduler.base_lrs = [o.lr for _ in groups]
        lrs = [base * fn(self.scheduler.last_epoch)
               for base, fn in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True)]
        for g, lr in zip(groups, lrs, strict=True):
            g.update(lr=lr, initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.scheduler._last_lr = lrs
        if changed:
            self.observer.event(f"resume: optim {', '.join(changed)} (config differs from the checkpoint); "
                                "applying the config's values")

    def resume(self) -> bool:
        # chosen (and checked) at the start of setup, before the models loaded
        path = self.__dict__.pop("_resume_from") if "_resume_from" in self.__dict__ else self._resume_candidate()
        if path is None:
            return False
        loaded = Drafter.load(path, device=self.device)
        self._check_same_drafter(loaded, path)
        self.drafter.load_state_dict(loaded.state_dict())
        state = load_trainer_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_optim_config()
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        rng = state["rng"]
        torch.random.set_rng_state(rng["torch"])
        _set_python_rng_state(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.observer.event(f"resumed from {path} at step {self.step}")
        return True

    # ------------------------------------------------------------------------------------------ steps
    def next_batch(self) -> tuple[int, Batch]:
        epoch, blen, idx = self.sampler.next()
        return epoch, collate(self.train_set.samples, idx, blen, self.tokenizer.pad_token_id or 0)

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.features(batch.input_ids, batch.attention_mask)

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def drafter_loss(self, features: torch.Tensor, batch: Batch, generator: torch.Generator, model=None,
                     num_anchors: int | None = None, leads: list | None = None):
        """Loss and stats of one batch given its target features (shared by every topology).

        `leads`: a list that receives (anchors (b, m), valid (b, m), leading correct predictions (b, m))."""
        c = self.config.drafter
        anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, num_anchors or c.num_anchors, generator)
        blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, c.block_size,
                              self.drafter.arch.mask_token_id)
        forward = model if model is not None else self.drafter
        embed = self.embed_tokens()
        self.last_flops = drafter_step_flops(self.drafter.arch, int(batch.lengths.sum()), anchors, valid,
                                             int(blocks.label_valid.sum()))
        head = self.lm_head_weight()
        if self.device.type != "cuda":  # no autocast off CUDA: a bf16 target's tensors meet fp32 drafter weights
            dtype = next(self.drafter.parameters()).dtype
            features, head = features.to(dtype), head.to(dtype)
        with self.autocast():
            hidden = forward(features, blocks.block_ids, blocks.anchors, embed, self.attention_kind, self._flex)
            loss, correct = weighted_block_loss(hidden, head, blocks, self.gamma, c.loss_chunk_size, c.loss_impl)
        if leads is not None:
            hit = (correct & blocks.label_valid).float()
            leads.append((anchors, valid, torch.cumprod(hit, dim=-1).sum(-1).long().cpu()))
        return loss, BlockStats.of(correct, blocks)

    def embed_tokens(self):
        return self.target.embed_tokens

    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head.weight

    def optimizer_step(self, grad_scale: float = 1.0) -> None:
        """Scale the accumulated gradients (the loss normaliser), clip, step."""
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        if grad_scale != 1.0 and grads:
            torch._foreach_mul_(grads, grad_scale)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

    def next_input(self) -> tuple[int, Batch, torch.Tensor]:
        """(epoch, batch on the device, target features) of this rank's next micro-batch.

        Disaggregated drafter ranks override this: they receive both from a target rank."""
        epoch, batch = self.next_batch()
        batch = batch.to(self.device)
        return epoch, batch, self.features(batch)

    def loss_weight(self, stats: BlockStats) -> float:
        """Sum of the position weights of the valid labels: the denominator of this micro-batch's loss."""
        w = position_weights(self.config.drafter.block_size, self.gamma, stats.valid_per_pos.device)
        return float((w * stats.valid_per_pos).sum())

    def grad_sync(self, last_micro_batch: bool):
        """Data-parallel ranks all-reduce gradients only in the backward of the last micro-batch."""
        if self.ddp_model is None or last_micro_batch:
            return contextlib.nullcontext()
        return self.ddp_model.no_sync()

    def reduce_step(self, totals: torch.Tensor) -> torch.Tensor:
        """Hook: sum [weighted loss, weight] over the data-parallel ranks; single process: identity."""
        return totals

    def train_step(self) -> tuple[int, StepResult]:
        """One optimizer step over optim.grad_accum micro-batches on each of world_size ranks.

        The loss is the weighted CE over the whole global batch divided by its total weight, so any split
        of the same global batch over ranks and micro-batches gives the same step (DESIGN §3, topology.md).
        """
        c = self.config
        accum = c.optim.grad_accum
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(2, dtype=torch.float64)
        stats, tokens = None, 0
        self.step_flops = 0.0
        for k in range(accum):
            t_in = time.perf_counter()
            epoch, batch, feats = self.next_input()
            if self.device.type == "cuda":  # the loss below syncs anyway; this makes the input time real
                torch.cuda.synchronize(self.device)
            self.input_seconds += time.perf_counter() - t_in
            # micro-batch k of rank r is item k*world_size + r of the global batch: its anchors do not depend
            # on how the global batch is split
            generator = step_generator(c.seed, self.step, k * self.world_size + self.rank)
            with self.grad_sync(k == accum - 1):
                loss, st = self.drafter_loss(feats, batch, generator, self.ddp_model)
                self.step_flops += self.last_flops.training
                weight = self.loss_weight(st)
                (loss * weight).backward()
            totals += torch.tensor([float(loss.detach()) * weight, weight], dtype=torch.float64)
            stats = st if stats is None else stats + st
            tokens += batch.num_tokens
        totals = self.reduce_step(totals)
        # DDP averaged the gradients over world_size ranks; undo that and divide by the global weight
        self.optimizer_step(self.world_size / max(float(totals[1]), 1e-12))
        self.step += 1
        return epoch, StepResult(float(totals[0]) / max(float(totals[1]), 1e-12), stats, tokens)

    def _eval_batches(self, dataset: TokenizedSet, max_batches: int):
        """The held-out batches every eval reads (a fixed order: evals are comparable across steps)."""
        c = self.config
        sampler = RoundRobinBatchSampler(dataset.lengths(), c.data.token_budget, c.data.bucket_size,
                                         c.data.max_length, seed=12345)
        for i, (blen, idx) in enumerate(sampler.epoch_batches(0)):
            if i >= max_batches:
                break
            yield i, collate(dataset.samples, idx, blen, self.tokenizer.pad_token_id or 0).to(self.device)

    @torch.no_grad()
    def evaluate(self, dataset: TokenizedSet | None = None, max_batches: int = 50) -> BlockStats | None:
        dataset = dataset or self.eval_set
        if dataset is None or len(dataset) == 0:
            return None
        total = None
        self.drafter.eval()
        for i, batch in self._eval_batches(dataset, max_batches):
            _, stats = self.drafter_loss(self.features(batch), batch, step_generator(999, i, 0), self.drafter.forward)
            total = stats if total is None else total + stats
        self.drafter.train()
        return total

    @torch.no_grad()
    def walk_tau(self, dataset: TokenizedSet | None = None, max_batches: int = 8) -> float | None:
        """Simulated acceptance length along the path greedy decoding takes, on the held-out data.

        Blocks are anchored at every answer position; the walk starts at the first answer token (the one the
        target's prefill produces), commits the block's leading correct predictions plus one, and anchors the
        next block there, as speculative decoding does. Where the data is the target's own greedy output this
        equals the real acceptance length (up to the generation limit); random anchors (`tau`) weigh every
        position alike and so overstate it when easy runs alternate with hard spots (rounds restart at the
        hard spots). A gap between this and the real acceptance length means the data is not the target's."""
        dataset = dataset or self.eval_set
        if dataset is None or len(dataset) == 0:
            return None
        rounds = committed = 0
        self.drafter.eval()
        for i, batch in self._eval_batches(dataset, max_batches):
            leads: list = []
            self.drafter_loss(self.features(batch), batch, step_generator(999, i, 0), self.drafter.forward,
                              num_anchors=int(batch.input_ids.shape[1]), leads=leads)
            anchors, valid, lead = leads[0]
            for r in range(anchors.shape[0]):
                table = {int(a): int(k) for a, k, v in zip(anchors[r], lead[r], valid[r], strict=True) if v}
                loss_pos = torch.nonzero(batch.loss_mask[r].cpu()).flatten()
                if loss_pos.numel() == 0:
                    continue
                a = int(loss_pos[0])
                while a in table:
                    rounds += 1
                    committed += table[a] + 1
                    a += table[a] + 1
        self.drafter.train()
        return committed / rounds if rounds else None

    # ------------------------------------------------------------------------------------------ loop
    def install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_requested = True
            print(f"received signal {signum}: checkpointing at the next step boundary", flush=True)

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, request_stop)
            if getattr(previous, "seen", False):  # launch.SignalLatch: a stop signal arrived during start-up
                self.stop_requested = True
                print("received a stop signal during start-up: stopping before training", flush=True)

    def memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return 0.0

    def run(self) -> dict[str, Any]:
        c = self.config
        self.drafter.train()
        window = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.time(), "stats": None}
        epoch = self.sampler.epoch
        self.observer.heartbeat(self.step, epoch, "training")
        last: dict[str, Any] = {}
        notifier = Notifier()  # the supervisor's watchdog: a ping per step (dflash/notify.py)
        while self.step < self.total_steps and not self.stop_requested:
            epoch, res = self.train_step()
            window["loss"] += res.loss
            window["n"] += 1
            window["tokens"] += res.tokens
            window["flops"] = window.get("flops", 0.0) + self.step_flops
            window["input_s"] = window.get("input_s", 0.0) + self.input_seconds
            self.input_seconds = 0.0
            window["stats"] = res.stats if window["stats"] is None else window["stats"] + res.stats
            if not math.isfinite(res.loss):
                raise RuntimeError(f"loss is {res.loss} at step {self.step}; lower optim.lr or check the data")
            if self.step % c.logging.interval == 0 or self.step == self.total_steps:
                last = self._report(epoch, window)
                window = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.time(), "stats": None}
            if self.step % c.checkpoint.interval == 0:
                self.save_checkpoint()
            if c.logging.eval_interval and self.step % c.logging.eval_interval == 0:
                self._report_eval()
            notifier.step(self.step)
        if self.step > 0 and (not self.ckpt.list() or self.ckpt.list()[-1] != self.ckpt.path_for(self.step)):
            self.save_checkpoint()  # (step 0: stopped before any step; nothing to keep)
        stopped = self.stop_requested and self.step < self.total_steps
        result = {**last, "step": self.step, "epoch": epoch, "stopped": stopped}  # the real step, not the last log's
        if not stopped:
            ev = self._report_eval()
            if ev is not None:
                result["eval_tau"] = ev["tau"]
                result["eval_tau_walk"] = ev.get("tau_walk")
                result["eval_acc"] = ev["acc"]
                if "acceptance_length" in ev:
                    result["eval_acceptance_length"] = ev["acceptance_length"]
                    result["eval_lossless"] = ev["lossless"]
        self.observer.heartbeat(self.step, epoch, "stopped" if stopped else "finished",
                                loss=last.get("loss"), tau=last.get("tau"), **self._eval_beat())
        self.observer.close()
        return result

    def _eval_beat(self) -> dict[str, Any]:
        """The last eval's numbers for the heartbeat (simulated tau and the real acceptance length)."""
        ev = self.last_eval or {}
        return {"eval_step": ev.get("step"), "eval_tau": ev.get("tau"),
                "eval_acceptance_length": ev.get("acceptance_length")}

    def reduce_stats(self, loss_sum: float, n: int, tokens: int, stats: BlockStats):
        """Hook for data-parallel ranks to sum their windows; single process: identity."""
        return loss_sum, n, tokens, stats

    def _report(self, epoch: int, window: dict[str, Any]) -> dict[str, Any]:
        loss_sum, n, tokens, stats = self.reduce_stats(window["loss"], window["n"], window["tokens"], window["stats"])
        elapsed = max(time.time() - window["t0"], 1e-9)
        record = {"step": self.step, "epoch": epoch, "loss": loss_sum / max(n, 1), "acc": stats.accuracy,
                  "tau": stats.tau, "tokens_per_s": tokens / elapsed,
                  "blocks_per_s": float(stats.num_blocks) / elapsed, "lr": self.scheduler.get_last_lr()[0],
                  "mem_gib": self.memory_gib()}
        peak = peak_flops(self.device, self.config.runtime.peak_tflops)
        if peak:
            record["mfu"] = window.get("flops", 0.0) / elapsed / peak
        # share of the wall time this rank spent obtaining inputs: the target forward (colocated) or waiting
        # for a target rank's transfer (disaggregated drafter rank)
        record["input_frac"] = min(window.get("input_s", 0.0) / elapsed, 1.0)
        self.observer.log(record)
        self.observer.heartbeat(self.step, epoch, "training", loss=record["loss"], tau=record["tau"],
                                tokens_per_s=record["tokens_per_s"], **self._eval_beat())
        return record

    def _report_eval(self) -> dict[str, Any] | None:
        """Simulated tau on the held-out set, and the real acceptance length of speculative decoding."""
        stats = self.evaluate()
        if stats is None:
            return None
        record: dict[str, Any] = {"step": self.step, "tau": stats.tau, "acc": stats.accuracy}
        try:
            walk = self.walk_tau()
        except torch.OutOfMemoryError:  # every answer position anchored at once: a report, never a crash
            walk = None
            self.observer.event("eval: not enough GPU memory for the decoding-path tau; skipped")
        if walk is not None:
            record["tau_walk"] = walk
        real = self.speculative_eval()
        if real is not None:
            record.update(acceptance_length=real.acceptance_length, lossless=real.lossless,
                          prompts=len(real.prompts), speedup=real.speedup)
        text = f"eval step {self.step}: simulated tau {stats.tau:.3f} (along the decoding path {walk or 0:.3f}) " \
               f"acc@1 {stats.accuracy[0]:.3f}"
        if real is not None:
            text += (f"; real acceptance length {real.acceptance_length:.3f} over {len(real.prompts)} prompts "
                     f"(lossless {sum(p.lossless for p in real.prompts)}/{len(real.prompts)})")
        self.observer.event(text)
        self.observer.log_eval(record)
        self.last_eval = record
        return record

    def speculative_eval(self):
        """Real greedy speculative decoding of a few held-out prompts (eval.*); None when off or impossible."""
        from dflash.evaluate import eos_ids_of, evaluate_speculative, prompts_from_tokenized

        e = self.config.eval
        if not e.speculative_prompts or self.target is None or self.eval_set is None or not self.is_reporter:
            return None
        prompts = prompts_from_tokenized(self.eval_set, e.speculative_prompts)
        if not prompts:
            return None
        with torch.no_grad(), self.autocast():
            return evaluate_speculative(self.target, self.drafter, prompts, e.max_new_tokens, eos_ids_of(self.tokenizer),
                                        vocab_limit=len(self.tokenizer), check_lossless=False)


def train(config: RunConfig) -> dict[str, Any]:
    """Single-process training. A stop signal during start-up (caught by launch.SignalLatch) ends it cleanly:
    before setup, nothing is loaded; during setup, it stops before the first step."""
    if getattr(signal.getsignal(signal.SIGTERM), "seen", False):
        print("received a stop signal during start-up: not starting", flush=True)
        return {"step": 0, "stopped": True}
    trainer = Trainer(config).setup()
    trainer.install_signal_handlers()
    try:
        return trainer.run()
    except BaseException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with contextlib.suppress(OSError):  # a full disk must not hide the error itself
            trainer.observer.heartbeat(trainer.step, trainer.sampler.epoch, "failed", error=reason)
        raise
    finally:
        # the work is done (or failed): a late stop signal must not kill the interpreter mid-shutdown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


__all__ = ["Trainer", "train"]
