"""`dflash eval --suite NAME=PATH`: the benchmark prompt sets of speculative-decoding papers, one table.

Each suite reads its rows in the published format (a local JSONL, JSON or parquet file, or `hf:DATASET_ID` through
the `datasets` library where the hub can be reached), turns each row into one user message (SUITES: the builder of
each is documented there and in docs/evaluation.md), renders it with the tokenizer's chat template (thinking on,
off, or the template's default) and decodes it through the same path as `dflash eval` and the trainer's evals
(`dflash.evaluate.Evaluator.speculative`: greedy, target alone and with the drafter, losslessness). The result
per suite: prompts, mean acceptance length, the acceptance of each draft position, lossless prompts and tokens/s;
printed as a table and written as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.errors import BadInput, DataError
from dflash.evaluate import (
    THINKING_FLAGS,
    EvalReport,
    Evaluator,
    LosslessnessError,
    Prompt,
    TargetFeatures,
    eos_ids_of,
    load_eval_models,
    render_prompt_ids,
)

DEFAULT_LIMIT = 80  # prompts per suite
TABLE_POSITIONS = 4  # draft positions shown in the printed table (the JSON has all B-1)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _field(row: dict[str, Any], where: str, suite: str, *names: str) -> str:
    """The first of `names` the row has, as a non-empty string."""
    for name in names:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    raise BadInput(f"{where}: a {suite} row needs a non-empty string '{names[0]}'"
                   + (f" (or '{names[1]}')" if len(names) > 1 else "") + f"; {SUITES[suite].format}")


def _gsm8k(row, where):
    return f"{_field(row, where, 'gsm8k', 'question')}\n{MATH_INSTRUCTION}"


def _math500(row, where):
    return f"{_field(row, where, 'math500', 'problem')}\n{MATH_INSTRUCTION}"


def _humaneval(row, where):
    return _field(row, where, "humaneval", "prompt")


def _mbpp(row, where):
    return _field(row, where, "mbpp", "prompt", "text")


def _mtbench(row, where):
    turns = row.get("turns", row.get("prompt"))
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise BadInput(f"{where}: an mtbench row needs 'turns' (or 'prompt'), a list whose first item is a "
                       f"non-empty string; {SUITES['mtbench'].format}")
    return turns[0]


def _alpaca(row, where):
    instruction = _field(row, where, "alpaca", "instruction")
    extra = row.get("input")
    return f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    format: str  # the published row format, for error messages and docs
    build: Callable[[dict[str, Any], str], str]  # (row, where) -> the user message
    hub_split: str  # the split `hf:ID` reads when none is named
    id_fields: tuple[str, ...] = ()


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gsm8k", "GSM8K", "GSM8K rows are {question, answer}", _gsm8k, "test"),
    Suite("math500", "MATH-500", "MATH-500 rows are {problem, solution, answer, ...}", _math500, "test",
          ("unique_id",)),
    Suite("humaneval", "HumanEval", "HumanEval rows are {task_id, prompt, canonical_solution, test, entry_point}",
          _humaneval, "test", ("task_id",)),
    Suite("mbpp", "MBPP", "MBPP rows are {task_id, text, code, test_list, ...} or, sanitized, {task_id, prompt, "
          "code, test_list, ...}", _mbpp, "test", ("task_id",)),
    Suite("mtbench", "MT-Bench", "MT-Bench rows are {question_id, category, turns: [...]} (or {prompt: [...], "
          "category})", _mtbench, "train", ("question_id", "prompt_id")),
    Suite("alpaca", "Alpaca", "Alpaca rows are {instruction, input, output}", _alpaca, "train"),
)}


def parse_suites(specs: list[str]) -> list[tuple[str, str]]:
    """`--suite NAME=PATH[,NAME=PATH...]` (repeatable) -> [(name, source)] in the order given."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, source = item.partition("=")
            name = name.strip().lower()
            if not sep or not source.strip():
                raise BadInput(f"--suite '{item}': give NAME=PATH (NAME one of {', '.join(SUITES)})")
            if name not in SUITES:
                raise BadInput(f"--suite '{item}': unknown suite '{name}'; the known suites are "
                               f"{', '.join(SUITES)}")
            if any(name == seen for seen, _ in out):
                raise BadInput(f"--suite names '{name}' twice")
            out.append((name, source.strip()))
    if not out:
        raise BadInput(f"--suite: give NAME=PATH (NAME one of {', '.join(SUITES)})")
    return out


def _hub_rows(suite: Suite, source: str) -> list[tuple[str, dict[str, Any]]]:
    """`hf:DATASET_ID[@CONFIG][:SPLIT]` through `datasets.load_dataset` (needs the hub or its cache)."""
    spec = source[len("hf:"):]
    spec, _, split = spec.partition(":")
    dataset_id, _, config = spec.partition("@")
    if not dataset_id:
        raise BadInput(f"--suite {suite.name}={source}: give hf:DATASET_ID[@CONFIG][:SPLIT]")
    try:
        import datasets
    except ImportError:
        raise BadInput(f"--suite {suite.name}={source} needs the `datasets` package: pip install "
                       "'dflash-trainer[data]'") from None
    try:
        table = datasets.load_dataset(dataset_id, config or None, split=split or suite.hub_split)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"--suite {suite.name}={source}: the datasets library could not load it ({text}); "
                       "without the hub, pass a local file in the published format") from None
    return [(f"{dataset_id}: row {i}", row) for i, row in enumerate(table, 1)]


def read_suite(name: str, source: str, limit: int) -> list[tuple[str, str]]:
    """The first `limit` rows of a suite as (prompt name, user message); a row of another format is one BadInput
    naming the file and row."""
    from dflash.data.prompts import iter_rows

    suite = SUITES[name]
    out: list[tuple[str, str]] = []
    try:
        if source.startswith("hf:"):
            rows = iter(_hub_rows(suite, source))
        else:
            rows = ((where, row) for _, where, row in iter_rows(source, f"--suite {name}=PATH names a local "
                                                                        f"file ({suite.format})"))
        for where, row in rows:
            if len(out) >= limit:
                break
            if not isinstance(row, dict):
                raise BadInput(f"{where}: expected a JSON object; {suite.format}")
            key = next((str(row[f]) for f in suite.id_fields if row.get(f) is not None), str(len(out) + 1))
            out.append((f"{name}:{key}", suite.build(row, where)))
    except DataError as exc:  # a file the user named for this run: bad input, like any other suite row
        raise BadInput(str(exc)) from None
    if not out:
        raise BadInput(f"--suite {name}={source}: holds no rows")
    return out


def per_position_acceptance(histogram: list[int]) -> list[float]:
    """Share of rounds whose k-th drafted token was accepted, k = 1..B-1 (histogram[j]: rounds that committed j+1
    tokens, i.e. accepted j drafted tokens)."""
    rounds = sum(histogram)
    return [sum(histogram[k:]) / rounds if rounds else 0.0 for k in range(1, len(histogram))]


def suite_result(name: str, source: str, report: EvalReport) -> dict[str, Any]:
    return {"suite": name, "title": SUITES[name].title, "source": source, **report.summary(),
            "per_position_acceptance": per_position_acceptance(report.histogram),
            "prompts": [vars(p) for p in report.prompts]}


def render_table(results: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    positions = min(TABLE_POSITIONS, max((len(r["per_position_acceptance"]) for r in results), default=0))
    lines = [f"real acceptance length per suite (block {settings['block_size']}, greedy, up to "
             f"{settings['max_new_tokens']} new tokens, thinking {settings['thinking']})"]
    if settings["thinking"] in ("on", "off", "disable") and not settings["template_reads_enable_thinking"]:
        lines.append("note: this chat template does not read enable_thinking; --thinking changed nothing")
    head = (f"{'suite':<10} {'prompts':>7} {'accept':>7} " + " ".join(f"{'p' + str(k + 1):>5}" for k in range(positions))
            + f" {'lossless':>9} {'target t/s':>10} {'spec t/s':>9} {'speedup':>7}")
    lines += [head, "-" * len(head)]
    for r in results:
        pos = " ".join(f"{a:>5.2f}" for a in r["per_position_acceptance"][:positions])
        lossless = f"{r['lossless_prompts']}/{r['num_prompts']}"
        lines.append(f"{r['suite']:<10} {r['num_prompts']:>7} {r['acceptance_length']:>7.3f} {pos} {lossless:>9} "
                     f"{r['target_tokens_per_s']:>10.1f} {r['speculative_tokens_per_s']:>9.1f} "
                     f"{r['speedup']:>6.2f}x")
    lines.append(f"p1..p{positions}: share of rounds whose k-th drafted token was accepted; tokens/s and speedup "
                 "are this machine's (the target alone and with the drafter, one prompt at a time)")
    return "\n".join(lines)


def run_suites(args) -> int:
    """The CLI: every suite file is read and checked before any model loads."""
    if args.prompts:
        raise BadInput("--suite and --prompts: give one of them")
    if args.suite_limit < 1:
        raise BadInput("--suite-limit must be >= 1")
    suites = [(name, source, read_suite(name, source, args.suite_limit)) for name, source in parse_suites(args.suite)]
    setup = load_eval_models(args.config, args.drafter, args.overrides, args.out)
    tokenizer = setup.tokenizer
    enable_thinking = THINKING_FLAGS[args.thinking]
    settings = {"config": str(args.config), "drafter": str(setup.source), "block_size": setup.drafter.arch.block_size,
                "max_new_tokens": args.max_new_tokens, "suite_limit": args.suite_limit, "thinking": args.thinking,
                "enable_thinking": enable_thinking,
                "template_reads_enable_thinking": "enable_thinking" in str(getattr(tokenizer, "chat_template", "")),
                "device": str(setup.device), "decoding": "greedy, batch 1, target alone then with the drafter"}
    evaluator = Evaluator(setup.drafter, TargetFeatures(setup.target), prompts=[], max_new_tokens=args.max_new_tokens,
                          eos_ids=eos_ids_of(tokenizer), vocab_limit=len(tokenizer))
    results = []
    for name, source, rows in suites:
        prompts = [Prompt(key, render_prompt_ids(tokenizer, [{"role": "user", "content": text}], enable_thinking))
                   for key, text in rows]
        results.append(suite_result(name, source, evaluator.speculative(prompts)))
    settings["seconds"] = time.time() - setup.started
    document = {"settings": settings, "suites": {r["suite"]: r for r in results}}
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2) if args.json else render_table(results, settings))
    bad = [f"{r['suite']} {p['name']} (first difference at {p['first_difference']})"
           for r in results for p in r["prompts"] if not p["lossless"]]
    if bad:
        raise LosslessnessError("speculative decoding differed from the target's greedy decoding on " + ", ".join(bad))
    return 0
