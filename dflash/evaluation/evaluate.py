"""Evaluation of a drafter against its target: the trainer's evals and `dflash eval`, one code path.

`Evaluator` is the component both use. It owns which held-out batches an eval reads, the simulated tau over
them (the training pass, `dflash.components.loss.BlockPass`, with the drafter's own compiled forward), the tau along the
decoding path, the real acceptance length of greedy speculative decoding on its prompts, and the eval record
it reports (the log line, the `"kind": "eval"` line of metrics.jsonl, the heartbeat's eval fields).

Real decoding (`evaluate_speculative`) reports the mean acceptance length (tokens committed per target
forward, 1..B), its histogram, per-prompt values, tokens/s with the drafter and for the target alone on the
same prompts, the speedup, and losslessness: every output must equal the target's own greedy decoding (a
mismatch is an error naming the prompt and the first differing position). On request it also decodes each prompt
with transformers' prompt-lookup decoding, the baseline a drafter has to beat, measured the same way.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash.components.loss import BlockPass, BlockStats, step_generator
from dflash.data.buckets import Batch, BatchShape, RoundRobinBatchSampler, collate
from dflash.data.chat import TokenizedSet
from dflash.errors import BadInput, DflashError
from dflash.evaluation.speculative import (
    PROMPT_LOOKUP_NGRAM,
    first_difference,
    greedy_generate,
    prompt_lookup_generate,
    speculative_generate,
)
from dflash.logs import get_logger
from dflash.models.drafter import Drafter
from dflash.models.target import Target
from dflash.runtime import stop

log = get_logger(__name__)

# A first difference where the target's own top-2 logits were closer than this (relative to the top logit) is a
# numerical tie of the target's dtype (batched verify vs one-token decode round differently), not a loss.
TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class LosslessnessError(DflashError):
    """Speculative decoding produced a token the target's greedy decoding would not have."""


class EvalNotLossless(LosslessnessError):
    """The trainer's own eval found such a token: the run fails, and that step never becomes the best. Its failure
    class (dflash/runtime/failures.py) is `bad_input`: a restart decodes the same way again, so it is never restarted."""

    failure_class = "bad_input"


@dataclass
class Prompt:
    name: str
    ids: torch.Tensor  # (T,) rendered exactly as in training, ending with the generation prompt
    answer_tokens: int = 0  # length of the reference answer (held-out data), 0 if unknown


@dataclass
class PromptResult:
    name: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    acceptance: float
    target_s: float
    speculative_s: float
    lossless: bool
    first_difference: int | None = None
    # the prompt-lookup baseline of this prompt (when asked for): new_tokens, forwards, acceptance, seconds,
    # lossless, first_difference
    prompt_lookup: dict[str, Any] | None = None


# output-position buckets of the acceptance length (a decay over long generations shows as falling numbers)
POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, None))


def bucket_label(lo: int, hi: int | None) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

    return f"{k(lo)}-{k(hi)}" if hi is not None else f"{k(lo)}+"


@dataclass
class EvalReport:
    block_size: int
    prompts: list[PromptResult] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # rounds that committed k tokens, k = 1..B
    ties: int = 0  # prompts whose first difference was a numerical tie of the target (TIE_TOLERANCE)
    prompt_lookup_tokens: int = 0  # the prompt-lookup baseline's candidate tokens per forward (0: not run)
    prompt_lookup_ngram: int = PROMPT_LOOKUP_NGRAM
    prompt_lookup_ties: int = 0
    prompt_lookup_error: str | None = None  # why transformers could not run it on this target (then skipped)
    # per POSITION_BUCKETS entry: [rounds, tokens committed] of the rounds whose first committed token falls at
    # that output position (the prefill's token is position 0; a round starts after it)
    by_position: list[list[int]] = field(default_factory=lambda: [[0, 0] for _ in POSITION_BUCKETS])

    def add_rounds(self, acceptance: list[int]) -> None:
        """One generation's rounds (tokens committed per round, in order), into the histogram and the buckets."""
        position = 1
        for a in acceptance:
            self.histogram[a - 1] += 1
            for i, (lo, hi) in enumerate(POSITION_BUCKETS):
                if position >= lo and (hi is None or position < hi):
                    self.by_position[i][0] += 1
                    self.by_position[i][1] += a
            position += a

    def acceptance_by_position(self) -> list[dict[str, Any]]:
        """The acceptance length per output-position bucket that holds rounds."""
        return [{"bucket": bucket_label(lo, hi), "from": lo, "to": hi, "rounds": n, "acceptance_length": t / n}
                for (lo, hi), (n, t) in zip(POSITION_BUCKETS, self.by_position, strict=True) if n]

    @property
    def acceptance_length(self) -> float:
        rounds = sum(self.histogram)
        return sum((k + 1) * n for k, n in enumerate(self.histogram)) / rounds if rounds else 0.0

    @property
    def lossless(self) -> bool:
        return all(p.lossless for p in self.prompts)

    def _rate(self, attr: str) -> float:
        seconds = sum(getattr(p, attr) for p in self.prompts)
        return sum(p.new_tokens for p in self.prompts) / seconds if seconds > 0 else 0.0

    @property
    def target_tokens_per_s(self) -> float:
        return self._rate("target_s")

    @property
    def speculative_tokens_per_s(self) -> float:
        return self._rate("speculative_s")

    @property
    def speedup(self) -> float:
        t = self.target_tokens_per_s
        return self.speculative_tokens_per_s / t if t else 0.0

    def prompt_lookup_summary(self) -> dict[str, Any] | None:
        """The prompt-lookup baseline over the prompts: acceptance length = (new tokens - 1) / (target forwards -
        1) summed over prompts, the definition of `acceptance_length` (output tokens per verify forward)."""
        if not self.prompt_lookup_tokens:
            return None
        runs = [p.prompt_lookup for p in self.prompts if p.prompt_lookup is not None]
        rounds = sum(r["forwards"] - 1 for r in runs)
        seconds = sum(r["seconds"] for r in runs)
        new_tokens = sum(r["new_tokens"] for r in runs)
        return {"acceptance_length": sum(r["new_tokens"] - 1 for r in runs) / rounds if rounds else 0.0,
                "num_prompts": len(runs), "lossless": bool(runs) and all(r["lossless"] for r in runs),
                "lossless_prompts": sum(r["lossless"] for r in runs), "numerical_ties": self.prompt_lookup_ties,
                "new_tokens": new_tokens, "target_forwards": sum(r["forwards"] for r in runs),
                "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
                "num_tokens": self.prompt_lookup_tokens, "max_matching_ngram_size": self.prompt_lookup_ngram,
                "error": self.prompt_lookup_error}

    def summary(self) -> dict[str, Any]:
        out = {"acceptance_length": self.acceptance_length, "block_size": self.block_size,
               "num_prompts": len(self.prompts), "lossless": self.lossless,
               "lossless_prompts": sum(p.lossless for p in self.prompts), "numerical_ties": self.ties,
               "histogram": {str(k + 1): n for k, n in enumerate(self.histogram)},
               "target_tokens_per_s": self.target_tokens_per_s,
               "speculative_tokens_per_s": self.speculative_tokens_per_s, "speedup": self.speedup,
               "acceptance_by_position": self.acceptance_by_position()}
        if self.prompt_lookup_tokens:
            out["prompt_lookup"] = self.prompt_lookup_summary()
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "prompts": [asdict(p) for p in self.prompts]}

    def render(self) -> str:
        s = self.summary()
        lines = [f"real acceptance length {s['acceptance_length']:.3f} (block {self.block_size}, "
                 f"{s['num_prompts']} prompts, greedy)",
                 f"lossless: {s['lossless_prompts']}/{s['num_prompts']} prompts equal the target's greedy output"
                 + (f" ({self.ties} up to a numerical tie of the target's dtype)" if self.ties else ""),
                 f"tokens/s: target alone {s['target_tokens_per_s']:.1f}, with the drafter "
                 f"{s['speculative_tokens_per_s']:.1f} (speedup {s['speedup']:.2f}x)",
                 "accepted per round: " + "  ".join(f"{k}:{n}" for k, n in s["histogram"].items())]
        buckets = s["acceptance_by_position"]
        if len(buckets) > 1:  # generations long enough to reach a second bucket
            lines.append("acceptance by output position: " + "  ".join(
                f"{b['bucket']}: {b['acceptance_length']:.3f} ({b['rounds']} rounds)" for b in buckets))
        lines += [f"{'prompt':<24} {'tokens':>7} {'rounds':>7} {'accept':>7} {'lossless':>8}"]
        for p in self.prompts:
            lines.append(f"{p.name:<24} {p.new_tokens:>7} {p.rounds:>7} {p.acceptance:>7.3f} "
                         f"{'yes' if p.lossless else 'NO @' + str(p.first_difference):>8}")
        return "\n".join(lines)


def prompts_from_tokenized(dataset: TokenizedSet, limit: int) -> list[Prompt]:
    """The prompt of each held-out sample: its tokens up to the first loss (assistant) token, exactly as the
    trainer rendered them, so the eval's prompt format equals training's."""
    prompts = []
    for i, (ids, mask) in enumerate(dataset.samples):
        if len(prompts) >= limit:
            break
        first = int(mask.int().argmax()) if bool(mask.any()) else 0
        if first == 0:
            continue
        prompts.append(Prompt(f"{dataset.source or 'eval'}#{i}", ids[:first].clone(), int(mask.sum())))
    return prompts


# --thinking: None leaves the chat template's default; True/False pass enable_thinking (Qwen3-class templates)
THINKING_FLAGS: dict[str, bool | None] = {"keep": None, "strip": None, "disable": False, "on": True, "off": False}


def render_prompt_ids(tokenizer, messages: list[dict[str, str]], enable_thinking: bool | None = None) -> torch.Tensor:
    """The prompt turns rendered with the generation prompt, as the eval decodes them."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                        **kwargs)
    return torch.tensor(ids, dtype=torch.long)


def prompts_from_file(path: str | Path, tokenizer, limit: int, enable_thinking: bool | None = None) -> list[Prompt]:
    """A prompt file (chat JSONL, or JSON/parquet: dflash/data/prompts.py): each row's turns up to its first
    assistant turn, rendered with the generation prompt."""
    from dflash.data.prompts import iter_conversations

    prompts = []
    for i, (_, _, messages) in enumerate(iter_conversations(path, "pass an existing --prompts file")):
        if len(prompts) >= limit:
            break
        head = []
        for m in messages:
            if m["role"] == "assistant":
                break
            head.append(m)
        if not head:
            raise BadInput(f"{path}: row {i + 1} has no prompt turn before its first assistant turn")
        prompts.append(Prompt(f"{Path(path).name}#{i + 1}", render_prompt_ids(tokenizer, head, enable_thinking)))
    if not prompts:
        raise BadInput(f"{path}: holds no prompts")
    return prompts


def eos_ids_of(tokenizer) -> list[int]:
    """The tokenizer's EOS plus the chat template's end-of-turn marker where it is a separate token."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)


def tie_tolerance_of(target: Target) -> float:
    """The tie tolerance of the dtype the target computes in: its own, or the autocast dtype it runs under (the
    trainer's evals on CUDA autocast to bfloat16, so a float32 target's logits there round like bfloat16's)."""
    param = next(target.model.parameters())
    dtype = param.dtype
    if torch.is_autocast_enabled(param.device.type) and dtype == torch.float32:
        dtype = torch.get_autocast_dtype(param.device.type)
    return TIE_TOLERANCE.get(dtype, 0.0)


def _versus(ref, other, tie_tolerance: float) -> tuple[int | None, bool]:
    """(first difference from the reference or None, whether a difference was a numerical tie of the target)."""
    diff = first_difference(ref.tokens, other.tokens)
    tie = diff is not None and diff < len(ref.margins) and ref.margins[diff] <= tie_tolerance
    return (None, True) if tie else (diff, False)


@torch.no_grad()
def evaluate_speculative(target: Target, drafter: Drafter, prompts: Iterable[Prompt], max_new_tokens: int,
                         eos_ids: list[int], vocab_limit: int | None = None, check_lossless: bool = True,
                         timings: bool = True, before_prompt: Callable[[], None] | None = None,
                         prompt_lookup: int = 0, prompt_lookup_ngram: int = PROMPT_LOOKUP_NGRAM,
                         on_output: Callable[[Prompt, list[int]], None] | None = None) -> EvalReport:
    """Decode every prompt greedily twice (target alone, then with the drafter) and compare.

    `check_lossless=True` raises `LosslessnessError` at the first mismatch; otherwise it is reported.
    `before_prompt` is called before each prompt (the trainer's stop check, which may raise).
    `prompt_lookup=N` also decodes each prompt with transformers' prompt-lookup decoding (N candidate tokens per
    forward, n-grams up to `prompt_lookup_ngram`), compared with the same reference; a target transformers cannot
    run it on is reported (`prompt_lookup_error`) and the baseline skipped.
    `on_output(prompt, tokens)` receives each prompt's reference output (the target's greedy tokens) before the
    next prompt is drawn, so `prompts` may be a generator whose next prompt continues the conversation."""
    if drafter.arch.mask_token_id >= target.vocab_size:
        raise BadInput(f"drafter mask_token_id {drafter.arch.mask_token_id} is outside the target's vocabulary")
    was_training = drafter.training
    drafter.eval()
    bs = drafter.arch.block_size
    report = EvalReport(block_size=bs, histogram=[0] * bs, prompt_lookup_tokens=prompt_lookup,
                        prompt_lookup_ngram=prompt_lookup_ngram)
    tie_tolerance = tie_tolerance_of(target)
    try:
        for p in prompts:
            if before_prompt is not None:
                before_prompt()
            ref = greedy_generate(target, p.ids, max_new_tokens, eos_ids, vocab_limit)
            spec = speculative_generate(target, drafter, p.ids, max_new_tokens, eos_ids, vocab_limit)
            diff, tie = _versus(ref, spec, tie_tolerance)
            if tie:
                report.ties += 1
            if diff is not None and check_lossless:
                raise LosslessnessError(
                    f"speculative decoding is not lossless on prompt {p.name}: first difference at generated "
                    f"position {diff} (target {ref.tokens[diff] if diff < len(ref.tokens) else 'end'}, "
                    f"speculative {spec.tokens[diff] if diff < len(spec.tokens) else 'end'})")
            report.add_rounds(spec.acceptance)
            lookup = _prompt_lookup(report, target, p, ref, max_new_tokens, eos_ids, vocab_limit, tie_tolerance,
                                    timings)
            report.prompts.append(PromptResult(
                p.name, int(p.ids.numel()), len(spec.tokens), len(spec.acceptance), spec.mean_acceptance,
                ref.seconds if timings else 0.0, spec.seconds if timings else 0.0, diff is None, diff, lookup))
            if on_output is not None:
                on_output(p, list(ref.tokens))
    finally:
        drafter.train(was_training)
    return report


def _prompt_lookup(report: EvalReport, target: Target, prompt: Prompt, ref, max_new_tokens: int,
                   eos_ids: list[int], vocab_limit: int | None, tie_tolerance: float,
                   timings: bool) -> dict[str, Any] | None:
    """The prompt-lookup baseline of one prompt, or None (not asked for, or transformers could not run it)."""
    if not report.prompt_lookup_tokens or report.prompt_lookup_error is not None:
        return None
    try:
        run = prompt_lookup_generate(target, prompt.ids, max_new_tokens, eos_ids, vocab_limit,
                                     report.prompt_lookup_tokens, report.prompt_lookup_ngram)
    except (ValueError, NotImplementedError, RuntimeError, TypeError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        text = str(exc).strip()
        report.prompt_lookup_error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        log.warning("prompt-lookup baseline skipped: transformers could not run it on this target (%s)",
                    report.prompt_lookup_error)
        return None
    diff, tie = _versus(ref, run, tie_tolerance)
    report.prompt_lookup_ties += tie
    return {"new_tokens": len(run.tokens), "forwards": run.forwards, "acceptance": run.mean_acceptance,
            "seconds": run.seconds if timings else 0.0, "lossless": diff is None, "first_difference": diff}


# ------------------------------------------------------------------------------------------ the evaluator
EVAL_SEED = 12345  # the held-out batches' order: the same at every eval, so evals are comparable across steps
ANCHOR_SEED = 999  # the held-out anchors: step_generator(ANCHOR_SEED, batch index, 0), the same at every eval


class FeatureSource(Protocol):
    """Where an evaluation's target features come from (the trainer's input source is one)."""

    target: Target | None  # the target in this process (real decoding needs it), or None

    def features(self, batch: Batch) -> torch.Tensor: ...

    def embed_tokens(self) -> torch.nn.Embedding: ...

    def lm_head_weight(self) -> torch.Tensor: ...


class TargetFeatures:
    """A target in this process as an evaluation's feature source."""

    def __init__(self, target: Target | None):
        self.target = target

    def features(self, batch: Batch) -> torch.Tensor:
        return self.target.features(batch.input_ids, None)  # right-padded rows: see `Target.features`

    def embed_tokens(self) -> torch.nn.Embedding:
        return self.target.embed_tokens

    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head.weight


class Evaluator:
    """One drafter evaluated against its target, at every eval of a run and by `dflash eval`.

    * `block_stats`: the simulated tau and per-position accuracy over up to `max_batches` held-out batches (a
      fixed order and fixed anchors: evals are comparable across steps);
    * `walk_tau`: the simulated acceptance length along the path greedy decoding takes, on `walk_batches` of them;
    * `speculative`: real greedy speculative decoding of the prompts (the target alone, then with the drafter);
    * `report(step)`: all three as one eval record, logged (`eval step N: ...`), written to metrics.jsonl
      (`"kind": "eval"`) and kept as `last` (the heartbeat's eval fields).

    The held-out passes call the drafter's own `forward` (compiled with the drafter, never a DDP wrapper: one
    process evaluates alone) through `block_pass`; without held-out data, its batch shape or a pass (`dflash
    eval`) only `speculative` runs. A stop request (dflash.runtime.stop) ends an eval at its next batch or prompt; the
    drafter's train/eval mode is restored whatever happens."""

    def __init__(self, drafter: Drafter, source: FeatureSource, *, prompts: list[Prompt], max_new_tokens: int,
                 eos_ids: list[int], vocab_limit: int | None = None, eval_set: TokenizedSet | None = None,
                 batch_shape: BatchShape | None = None, pad_token_id: int = 0, block_pass: BlockPass | None = None,
                 forward: Callable | None = None, autocast: Callable[[], Any] = contextlib.nullcontext,
                 observer: Any = None, max_batches: int = 50, walk_batches: int = 8):
        self.drafter = drafter
        self.source = source  # its methods are looked up at every call, never kept
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.vocab_limit = vocab_limit
        self.eval_set = eval_set
        self.batch_shape = batch_shape
        self.pad_token_id = pad_token_id
        self.block_pass = block_pass
        self.forward = forward if forward is not None else drafter.forward
        self.autocast = autocast
        self.observer = observer  # dflash.runtime.observability.RunObserver; None: the log line only
        self.max_batches = max_batches
        self.walk_batches = walk_batches
        self.last: dict[str, Any] | None = None  # the last eval record

    @classmethod
    def for_run(cls, config, drafter: Drafter, source: FeatureSource, tokenizer, eval_set: TokenizedSet | None,
                block_pass: BlockPass, *, forward: Callable | None = None,
                autocast: Callable[[], Any] = contextlib.nullcontext, observer: Any = None) -> Evaluator:
        """The trainer's evaluator: the run's held-out split, batched like training (`data`), and its first
        `eval.speculative_prompts` prompts decoded up to `eval_token_limit(config)` tokens."""
        e = config.eval
        prompts = prompts_from_tokenized(eval_set, e.speculative_prompts) if eval_set and e.speculative_prompts else []
        limit, _ = eval_token_limit(config)
        return cls(drafter, source, prompts=prompts, max_new_tokens=limit, eos_ids=eos_ids_of(tokenizer),
                   vocab_limit=len(tokenizer), eval_set=eval_set, batch_shape=BatchShape.of(config.data),
                   pad_token_id=tokenizer.pad_token_id or 0, block_pass=block_pass, forward=forward,
                   autocast=autocast, observer=observer)

    # -- the held-out batches
    def batches(self, dataset: TokenizedSet, max_batches: int) -> Iterator[tuple[int, Batch]]:
        """The held-out batches every eval reads (a fixed order: evals are comparable across steps)."""
        sampler = RoundRobinBatchSampler(dataset.lengths(), self.batch_shape, seed=EVAL_SEED)
        device = self.block_pass.device
        for i, (blen, idx) in enumerate(sampler.epoch_batches(0)):
            if i >= max_batches:
                break
            yield i, collate(dataset.samples, idx, blen, self.pad_token_id).to(device)

    def _pass(self, index: int, batch: Batch, num_anchors: int | None = None):
        stop.check()  # a stop request ends the eval here (`report` skips the rest)
        features = self.source.features(batch)
        return self.block_pass(self.forward, features, batch, step_generator(ANCHOR_SEED, index, 0),
                               self.source.embed_tokens(), self.source.lm_head_weight(), num_anchors)

    def _held_out(self, dataset: TokenizedSet | None) -> TokenizedSet | None:
        dataset = dataset or self.eval_set
        if dataset is None or len(dataset) == 0 or self.block_pass is None or self.batch_shape is None:
            return None
        return dataset

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.drafter.training
        self.drafter.eval()
        try:
            yield
        finally:
            self.drafter.train(was_training)

    @torch.no_grad()
    def block_stats(self, dataset: TokenizedSet | None = None, max_batches: int | None = None) -> BlockStats | None:
        """Simulated tau and per-position accuracy: the training pass at fixed anchors of held-out batches."""
        dataset = self._held_out(dataset)
        if dataset is None:
            return None
        total = None
        with self._eval_mode():
            for i, batch in self.batches(dataset, max_batches or self.max_batches):
                stats = self._pass(i, batch).stats
                total = stats if total is None else total + stats
        return total

    @torch.no_grad()
    def walk_tau(self, dataset: TokenizedSet | None = None, max_batches: int | None = None) -> float | None:
        """Simulated acceptance length along the path greedy decoding takes, on the held-out data.

        Blocks are anchored at every answer position; the walk starts at the first answer token (the one the
        target's prefill produces), commits the block's leading correct predictions plus one, and anchors the
        next block there, as speculative decoding does. Where the data is the target's own greedy output this
        equals the real acceptance length (up to the generation limit); random anchors (`tau`) weigh every
        position alike and so overstate it when easy runs alternate with hard spots (rounds restart at the
        hard spots). A gap between this and the real acceptance length means the data is not the target's."""
        dataset = self._held_out(dataset)
        if dataset is None:
            return None
        rounds = committed = 0
        with self._eval_mode():
            for i, batch in self.batches(dataset, max_batches or self.walk_batches):
                result = self._pass(i, batch, num_anchors=int(batch.input_ids.shape[1]))
                anchors, valid, lead = result.anchors, result.valid, result.leading_correct()
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
        return committed / rounds if rounds else None

    # -- real decoding
    def speculative(self, prompts: Iterable[Prompt] | None = None, check_lossless: bool = False,
                    timings: bool = True, prompt_lookup: int = 0,
                    on_output: Callable[[Prompt, list[int]], None] | None = None) -> EvalReport | None:
        """Real greedy speculative decoding of `prompts` (default: the evaluator's own); None without prompts or
        without a target in this process. `prompt_lookup` and `on_output`: see `evaluate_speculative`."""
        prompts = self.prompts if prompts is None else prompts
        target = self.source.target
        if not prompts or target is None:
            return None
        with torch.no_grad(), self.autocast():
            return evaluate_speculative(target, self.drafter, prompts, self.max_new_tokens, self.eos_ids,
                                        vocab_limit=self.vocab_limit, check_lossless=check_lossless,
                                        timings=timings, before_prompt=stop.check, prompt_lookup=prompt_lookup,
                                        on_output=on_output)

    # -- the record
    def _event(self, text: str) -> None:
        if self.observer is not None:
            self.observer.event(text)
        else:
            log.info(text)

    def report(self, step: int) -> dict[str, Any] | None:
        """The eval record of `step` (None: no held-out data, no target here, or a stop request ended it)."""
        if self.source.target is None:
            if self.eval_set is not None:
                log.info("eval skipped: disaggregated drafter ranks hold no target "
                         "(evaluate the exported drafter with `dflash export` and a serving engine)")
            return None
        try:
            return self.record(step)
        except stop.Interrupted:
            # the steps and their checkpoint are not waited on by an eval: a stop ends it where it is
            self._event(f"eval step {step}: interrupted by a stop request; no eval numbers for this step")
            return None

    def record(self, step: int) -> dict[str, Any] | None:
        """Simulated tau, tau along the decoding path and the real acceptance length of `step`: logged, written
        to metrics.jsonl and kept as `last`. Real decoding that is not lossless (beyond a numerical tie,
        TIE_TOLERANCE) is logged and written with `"lossless": false` and its first `mismatch`, then raises
        `EvalNotLossless` (never kept as `last`)."""
        stats = self.block_stats()
        if stats is None:
            return None
        record: dict[str, Any] = {"step": step, "tau": stats.tau, "acc": stats.accuracy}
        try:
            walk = self.walk_tau()
        except torch.OutOfMemoryError:  # every answer position anchored at once: a report, never a crash
            walk = None
            self._event("eval: not enough GPU memory for the decoding-path tau; skipped")
        if walk is not None:
            record["tau_walk"] = walk
        real = self.speculative()
        if real is not None:
            record.update(acceptance_length=real.acceptance_length, lossless=real.lossless,
                          prompts=len(real.prompts), speedup=real.speedup)
        text = f"eval step {step}: simulated tau {stats.tau:.3f} (along the decoding path {walk or 0:.3f}) " \
               f"acc@1 {stats.accuracy[0]:.3f}"
        if real is not None:
            text += (f"; real acceptance length {real.acceptance_length:.3f} over {len(real.prompts)} prompts "
                     f"(lossless {sum(p.lossless for p in real.prompts)}/{len(real.prompts)})")
        bad = [p for p in real.prompts if not p.lossless] if real is not None else []
        if bad:
            record["mismatch"] = {"prompt": bad[0].name, "position": bad[0].first_difference}
        self._event(text)
        if self.observer is not None:
            self.observer.log_eval(record)
        if bad:  # its acceptance length is not the target's: no best, no heartbeat numbers, the run stops
            raise EvalNotLossless(
                f"eval step {step}: speculative decoding is not lossless on prompt {bad[0].name}: first difference at "
                f"generated position {bad[0].first_difference} ({len(bad)} of {len(real.prompts)} prompts differ "
                f"beyond a numerical tie); step {step} is not made the best and the run stops, its checkpoints "
                "intact: check target.dtype and target.attn_implementation (the verify forward must decode as "
                "one-token steps do)")
        self.last = record
        return record

    def heartbeat_fields(self) -> dict[str, Any]:
        """The last eval's numbers for the heartbeat (simulated tau and the real acceptance length)."""
        ev = self.last or {}
        return {"eval_step": ev.get("step"), "eval_tau": ev.get("tau"),
                "eval_acceptance_length": ev.get("acceptance_length")}


# ------------------------------------------------------------------------------------------------ the limit
DEFAULT_MAX_NEW_TOKENS = 128  # an eval's new tokens per prompt where nothing says how long the run's answers are


def regenerated_answer_limit(path: str | None) -> int | None:
    """The max_new_tokens that `dflash regenerate` answered data file `path` with (its PATH.manifest.json), or
    None (no manifest: not regenerated, or by other means)."""
    if not path:
        return None
    manifest = Path(path).with_name(Path(path).name + ".manifest.json")
    try:
        value = json.loads(manifest.read_text())["sampling"]["max_new_tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def eval_token_limit(config) -> tuple[int, str]:
    """New tokens per eval prompt and where the number comes from: eval.max_new_tokens where the config sets it;
    else the limit the run's answers were regenerated with (data.regenerate.max_new_tokens, or the manifest of a
    `dflash regenerate` output named by data.eval_path or data.train_path): the trained answers end there, and
    decoding past them measures text the drafter never learned; else DEFAULT_MAX_NEW_TOKENS. The trainer's evals
    and `dflash eval` (without --max-new-tokens) decode the same."""
    e, d = config.eval, config.data
    if e.max_new_tokens is not None:
        return e.max_new_tokens, "eval.max_new_tokens"
    if d.regenerate is not None:
        return d.regenerate.max_new_tokens, "data.regenerate.max_new_tokens (the regenerated answers' limit)"
    for key in ("eval_path", "train_path"):
        found = regenerated_answer_limit(getattr(d, key))
        if found is not None:
            return found, f"the regenerated answers' max_new_tokens (data.{key}'s manifest)"
    return DEFAULT_MAX_NEW_TOKENS, "the default (eval.max_new_tokens unset, no regenerated answers)"


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a chosen checkpoint belongs to (RUN/checkpoints/step-N), or None (an export)."""
    from dflash.components.checkpoint import STEP_NAME

    checkpoint = Path(checkpoint)
    if STEP_NAME.fullmatch(checkpoint.name) and checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


# ------------------------------------------------------------------------------------------------ the CLI
def check_out_path(out: str) -> None:
    """`--out` can be written once the evaluation is done: checked before it starts (the result is not lost)."""
    path = Path(out)
    if path.is_dir():
        raise BadInput(f"--out '{out}' is a directory; name the JSON file to write")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise BadInput(f"--out '{out}': the directory '{parent}' does not exist; create it (mkdir -p {parent}) or "
                       "choose another path")


def check_drafter_fits(drafter: Drafter, text_config, source) -> None:
    """The drafter's shapes are the target's (hidden size, vocabulary, depth): one line naming both, before the
    target loads, instead of a shape error inside the first forward."""
    arch = drafter.arch
    want = {"hidden_size": int(text_config.hidden_size), "vocab_size": int(text_config.vocab_size)}
    if arch.num_target_layers:  # 0: a drafter exported before it was recorded
        want["num_target_layers"] = int(text_config.num_hidden_layers)
    bad = [f"{key} {getattr(arch, key)} (the target's: {value})" for key, value in want.items()
           if getattr(arch, key) != value]
    if bad:
        raise BadInput(f"drafter '{source}' does not fit the config's target: its {', '.join(bad)}; evaluate it "
                       "with the config (target) it was trained with")


@dataclass
class EvalSetup:
    """What `dflash eval` decodes with: the config's target and tokenizer, the drafter, on the device."""

    config: Any
    source: Path
    device: torch.device
    tokenizer: Any
    target: Target
    drafter: Drafter
    started: float
    chosen: str = "as given"  # why `source` (a run's best, its newest, ...)


def load_eval_models(config_path: str, drafter_path: str, overrides: list[str], out: str | None = None,
                     latest: bool = False) -> EvalSetup:
    """The config, the drafter (checked against the config's target before the target loads), the tokenizer
    and the target; `out` is checked first. A run directory gives its best checkpoint where it kept one, else its
    newest (`latest`: the newest), as `dflash export` does; one line on stderr says which was taken."""
    from dflash.components.export import choose_checkpoint
    from dflash.config import load_config, resolved_layer_ids
    from dflash.devices import pick_device
    from dflash.inputs import load_tokenizer
    from dflash.models.target import build_hf_model, num_layers_of, target_config, text_config_of

    config = load_config(config_path, overrides)
    if out:
        check_out_path(out)
    source, why = choose_checkpoint(drafter_path, "latest" if latest else "best")
    print(f"dflash eval: drafter {source} ({why})", file=sys.stderr)
    try:
        drafter = Drafter.load(source)
    except (ValueError, KeyError, OSError) as exc:
        raise BadInput(f"drafter '{source}' could not be loaded: {exc}") from None
    check_drafter_fits(drafter, text_config_of(target_config(config.target.path, config.target.random_init)), source)
    layer_ids = resolved_layer_ids(config, num_layers_of(config.target.path, config.target.random_init))
    if list(drafter.arch.target_layer_ids) != layer_ids:
        raise BadInput(f"drafter '{source}' taps target layers {drafter.arch.target_layer_ids} but the config's "
                       f"target taps {layer_ids}: evaluate it with the config it was trained with")
    device = pick_device(config.runtime.device)
    if config.runtime.num_threads:
        torch.set_num_threads(config.runtime.num_threads)
    tokenizer = load_tokenizer(config)
    t0 = time.time()
    model = build_hf_model(config.target.path, config.target.random_init, config.target.dtype,
                           config.target.attn_implementation, seed=config.seed, device=device)
    target = Target(model.to(device), layer_ids)
    drafter.to(device, next(target.model.parameters()).dtype if device.type == "cuda" else torch.float32)
    return EvalSetup(config, source, device, tokenizer, target, drafter, t0, why)


def run_eval(config_path: str, drafter_path: str, overrides: list[str], *, prompts_file: str | None,
             num_prompts: int, max_new_tokens: int | None, as_json: bool, out: str | None = None,
             thinking: str = "keep", latest: bool = False) -> int:
    """`dflash eval` without --suite. `max_new_tokens` None: what the run's evals decode (`eval_token_limit`).
    The held-out answers regenerated by the target (data.regenerate) are read from the evaluated run's cache;
    without one they are generated in memory: `dflash eval` writes no cache, in the config's output_dir or
    elsewhere."""
    from dflash.inputs import DataCaches, load_datasets

    setup = load_eval_models(config_path, drafter_path, overrides, out, latest=latest)
    config, source, device, tokenizer, target, drafter = (setup.config, setup.source, setup.device, setup.tokenizer,
                                                          setup.target, setup.drafter)
    if max_new_tokens is None:
        max_new_tokens, limit_from = eval_token_limit(config)
        limit_from = f"{limit_from} of {config_path}"
    else:
        limit_from = "--max-new-tokens"
    eos_ids = eos_ids_of(tokenizer)
    if prompts_file:
        prompts = prompts_from_file(prompts_file, tokenizer, num_prompts, THINKING_FLAGS[thinking])
    else:
        _, evalset = load_datasets(config, tokenizer, target=target, need_train=False,
                                   caches=DataCaches(run_dir_of(source), write=False))
        if evalset is None or len(evalset) == 0:
            raise BadInput("the run has no held-out split (set data.eval_path or data.eval_fraction > 0), or pass "
                           "--prompts FILE")
        prompts = prompts_from_tokenized(evalset, num_prompts)
    if not prompts:
        raise BadInput("no prompt to evaluate")
    evaluator = Evaluator(drafter, TargetFeatures(target), prompts=prompts, max_new_tokens=max_new_tokens,
                          eos_ids=eos_ids, vocab_limit=len(tokenizer))
    report = evaluator.speculative()
    result = {**report.to_dict(), "drafter": str(source), "drafter_chosen": setup.chosen, "config": str(config_path),
              "max_new_tokens": max_new_tokens, "max_new_tokens_from": limit_from, "eos_ids": eos_ids,
              "device": str(device), "seconds": time.time() - setup.started}
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    stops = f"EOS (token ids {', '.join(map(str, eos_ids))})" if eos_ids else "no EOS (the tokenizer names none)"
    limit_line = f"decoded up to {max_new_tokens} new tokens per prompt ({limit_from}), stopping at {stops}"
    print(json.dumps(result, indent=2) if as_json else limit_line + "\n" + report.render())
    if not report.lossless:
        bad = [f"{p.name} (first difference at {p.first_difference})" for p in report.prompts if not p.lossless]
        raise LosslessnessError("speculative decoding differed from the target's greedy decoding on "
                                + ", ".join(bad))
    return 0
