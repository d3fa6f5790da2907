"""`dflash eval`: real greedy speculative decoding of held-out prompts with the target and a drafter.

Reports the mean acceptance length (tokens committed per target forward, 1..B), its histogram, per-prompt
values, tokens/s with the drafter and for the target alone on the same prompts, the speedup, and
losslessness: every output must equal the target's own greedy decoding (a mismatch is an error naming the
prompt and the first differing position).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.data.chat import TokenizedSet
from dflash.errors import BadInput, DflashError
from dflash.models.drafter import Drafter
from dflash.models.target import Target
from dflash.speculative import first_difference, greedy_generate, speculative_generate

# A first difference where the target's own top-2 logits were closer than this (relative to the top logit) is a
# numerical tie of the target's dtype (batched verify vs one-token decode round differently), not a loss.
TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class LosslessnessError(DflashError):
    """Speculative decoding produced a token the target's greedy decoding would not have."""


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


@dataclass
class EvalReport:
    block_size: int
    prompts: list[PromptResult] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # rounds that committed k tokens, k = 1..B
    ties: int = 0  # prompts whose first difference was a numerical tie of the target (TIE_TOLERANCE)

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

    def summary(self) -> dict[str, Any]:
        return {"acceptance_length": self.acceptance_length, "block_size": self.block_size,
                "num_prompts": len(self.prompts), "lossless": self.lossless,
                "lossless_prompts": sum(p.lossless for p in self.prompts), "numerical_ties": self.ties,
                "histogram": {str(k + 1): n for k, n in enumerate(self.histogram)},
                "target_tokens_per_s": self.target_tokens_per_s,
                "speculative_tokens_per_s": self.speculative_tokens_per_s, "speedup": self.speedup}

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
                 "accepted per round: " + "  ".join(f"{k}:{n}" for k, n in s["histogram"].items()),
                 f"{'prompt':<24} {'tokens':>7} {'rounds':>7} {'accept':>7} {'lossless':>8}"]
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


@torch.no_grad()
def evaluate_speculative(target: Target, drafter: Drafter, prompts: list[Prompt], max_new_tokens: int,
                         eos_ids: list[int], vocab_limit: int | None = None, check_lossless: bool = True,
                         timings: bool = True, before_prompt: Callable[[], None] | None = None) -> EvalReport:
    """Decode every prompt greedily twice (target alone, then with the drafter) and compare.

    `check_lossless=True` raises `LosslessnessError` at the first mismatch; otherwise it is reported.
    `before_prompt` is called before each prompt (the trainer's stop check, which may raise)."""
    if drafter.arch.mask_token_id >= target.vocab_size:
        raise BadInput(f"drafter mask_token_id {drafter.arch.mask_token_id} is outside the target's vocabulary")
    was_training = drafter.training
    drafter.eval()
    bs = drafter.arch.block_size
    report = EvalReport(block_size=bs, histogram=[0] * bs)
    tie_tolerance = TIE_TOLERANCE.get(next(target.model.parameters()).dtype, 0.0)
    try:
        for p in prompts:
            if before_prompt is not None:
                before_prompt()
            ref = greedy_generate(target, p.ids, max_new_tokens, eos_ids, vocab_limit)
            spec = speculative_generate(target, drafter, p.ids, max_new_tokens, eos_ids, vocab_limit)
            diff = first_difference(ref.tokens, spec.tokens)
            tie = diff is not None and diff < len(ref.margins) and ref.margins[diff] <= tie_tolerance
            if tie:
                report.ties += 1
                diff = None
            if diff is not None and check_lossless:
                raise LosslessnessError(
                    f"speculative decoding is not lossless on prompt {p.name}: first difference at generated "
                    f"position {diff} (target {ref.tokens[diff] if diff < len(ref.tokens) else 'end'}, "
                    f"speculative {spec.tokens[diff] if diff < len(spec.tokens) else 'end'})")
            for a in spec.acceptance:
                report.histogram[a - 1] += 1
            report.prompts.append(PromptResult(
                p.name, int(p.ids.numel()), len(spec.tokens), len(spec.acceptance), spec.mean_acceptance,
                ref.seconds if timings else 0.0, spec.seconds if timings else 0.0, diff is None, diff))
    finally:
        drafter.train(was_training)
    return report


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


def load_eval_models(config_path: str, drafter_path: str, overrides: list[str], out: str | None = None) -> EvalSetup:
    """The config, the drafter (checked against the config's target before the target loads), the tokenizer
    and the target; `out` is checked first."""
    from dflash.config import load_config, resolved_layer_ids
    from dflash.devices import pick_device
    from dflash.export import resolve_checkpoint
    from dflash.inputs import load_tokenizer
    from dflash.models.target import build_hf_model, num_layers_of, target_config, text_config_of

    config = load_config(config_path, overrides)
    if out:
        check_out_path(out)
    source = resolve_checkpoint(drafter_path)
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
    return EvalSetup(config, source, device, tokenizer, target, drafter, t0)


def run_eval(config_path: str, drafter_path: str, overrides: list[str], *, prompts_file: str | None,
             num_prompts: int, max_new_tokens: int, as_json: bool, out: str | None = None,
             thinking: str = "keep") -> int:
    from dflash.inputs import load_datasets

    setup = load_eval_models(config_path, drafter_path, overrides, out)
    config, source, device, tokenizer, target, drafter = (setup.config, setup.source, setup.device, setup.tokenizer,
                                                          setup.target, setup.drafter)
    if prompts_file:
        prompts = prompts_from_file(prompts_file, tokenizer, num_prompts, THINKING_FLAGS[thinking])
    else:
        _, evalset = load_datasets(config, tokenizer, target=target, need_train=False)
        if evalset is None or len(evalset) == 0:
            raise BadInput("the run has no held-out split (set data.eval_path or data.eval_fraction > 0), or pass "
                           "--prompts FILE")
        prompts = prompts_from_tokenized(evalset, num_prompts)
    if not prompts:
        raise BadInput("no prompt to evaluate")
    report = evaluate_speculative(target, drafter, prompts, max_new_tokens, eos_ids_of(tokenizer),
                                  vocab_limit=len(tokenizer), check_lossless=False)
    result = {**report.to_dict(), "drafter": str(source), "config": str(config_path),
              "max_new_tokens": max_new_tokens, "device": str(device), "seconds": time.time() - setup.started}
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if as_json else report.render())
    if not report.lossless:
        bad = [f"{p.name} (first difference at {p.first_difference})" for p in report.prompts if not p.lossless]
        raise LosslessnessError("speculative decoding differed from the target's greedy decoding on "
                                + ", ".join(bad))
    return 0
