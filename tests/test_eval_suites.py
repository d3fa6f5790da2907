"""`dflash eval --suite` (issue 30, item 5): benchmark prompt sets in their published formats, one table and one
JSON report per run, through the same decoding as `dflash eval` (a tiny random target and an untrained drafter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.errors import BadInput
from dflash.evaluation.suites import (
    HUMANEVAL_INSTRUCTION,
    MATH_INSTRUCTION,
    SUITES,
    parse_suites,
    per_position_acceptance,
    read_suite,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"

GSM8K = [{"question": f"Natalia sold clips to {n} of her friends. How many clips?", "answer": f"#### {n}"}
         for n in (48, 12, 7)]
MTBENCH = [{"question_id": 81 + i, "category": "writing", "turns": [f"count by {i + 1} from w1", "again"]}
           for i in range(3)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, untrained_drafter):
    """The tiny config (no data needed: the suites are the prompts) and an untrained drafter of its target."""
    return untrained_drafter(tmp_path_factory.mktemp("suites"))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("dflash: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_two_local_suites_print_the_table_and_write_the_json(run, tmp_path, capsys):
    config, drafter = run
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    mtbench = write_jsonl(tmp_path / "question.jsonl", MTBENCH)
    out = tmp_path / "suites.json"
    rc = main(["eval", str(config), str(drafter), "--suite", f"gsm8k={gsm8k},mtbench={mtbench}", "--suite-limit", "2",
               "--max-new-tokens", "6", "--thinking", "off", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    lines = printed.splitlines()
    assert lines[0].startswith("real acceptance length per suite (block 8, greedy, up to 6 new tokens, thinking off)")
    assert "does not read enable_thinking" in printed  # the synthetic tokenizer's template has no such switch
    header = next(line for line in lines if line.startswith("suite"))
    assert header.split() == ["suite", "prompts", "accept", "p1", "p2", "p3", "p4", "lossless", "target", "t/s",
                              "spec", "t/s", "speedup", "lookup"]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["gsm8k"], ["mtbench"])}
    assert set(rows) == {"gsm8k", "mtbench"}
    assert rows["gsm8k"][1] == "2" and rows["gsm8k"][7] == "2/2"
    assert rows["mtbench"][1] == "4" and rows["mtbench"][7] == "4/4"  # two rows, two turns each

    report = json.loads(out.read_text())
    assert report["settings"]["thinking"] == "off" and report["settings"]["enable_thinking"] is False
    assert report["settings"]["block_size"] == 8 and report["settings"]["suite_limit"] == 2
    assert list(report["suites"]) == ["gsm8k", "mtbench"]
    for name, suite in report["suites"].items():
        assert suite["source"] == str(gsm8k if name == "gsm8k" else mtbench)
        turns = 2 if name == "mtbench" else 1
        assert suite["rows"] == 2 and suite["num_prompts"] == suite["lossless_prompts"] == 2 * turns
        assert suite["lossless"]
        # the acceptance length is the committed tokens per verify round, from the rounds themselves: the
        # histogram's mean, and each prompt's tokens after its prefill token over its rounds
        histogram = {int(k): n for k, n in suite["histogram"].items()}
        rounds = sum(histogram.values())
        assert rounds == sum(p["rounds"] for p in suite["prompts"]) > 0
        assert sum(k * n for k, n in histogram.items()) == sum(p["new_tokens"] - 1 for p in suite["prompts"])
        assert suite["acceptance_length"] == pytest.approx(sum(k * n for k, n in histogram.items()) / rounds)
        assert len(suite["per_position_acceptance"]) == 7
        assert all(0.0 <= a <= 1.0 for a in suite["per_position_acceptance"])
        assert f"{suite['acceptance_length']:.3f}" == rows[name][2]
        histogram = [suite["histogram"][str(k)] for k in range(1, 9)]
        assert suite["per_position_acceptance"] == per_position_acceptance(histogram)
        assert [p["name"] for p in suite["prompts"]] == (
            ["gsm8k:1", "gsm8k:2"] if name == "gsm8k"
            else ["mtbench:81/turn1", "mtbench:81/turn2", "mtbench:82/turn1", "mtbench:82/turn2"])


def test_a_malformed_suite_file_exits_2_naming_the_file_and_row_before_any_model_loads(run, tmp_path, capsys,
                                                                                        monkeypatch):
    from dflash.models import target

    monkeypatch.setattr(target, "build_hf_model", lambda *a, **k: pytest.fail("the target was loaded"))
    config, drafter = run
    good = write_jsonl(tmp_path / "mt.jsonl", MTBENCH)
    bad = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K[0], {"problem": "a MATH row in the GSM8K file"}])
    assert main(["eval", str(config), str(drafter), "--suite", f"mtbench={good}", "--suite", f"gsm8k={bad}"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"dflash: error: {bad}:2: a gsm8k row needs a non-empty string 'question'")
    bad.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    assert main(["eval", str(config), str(drafter), "--suite", f"gsm8k={bad}"]) == 2
    assert f"{bad}:2: malformed JSON" in one_error_line(capsys)


def test_an_unknown_suite_exits_2_listing_the_known_ones(run, tmp_path, capsys):
    config, drafter = run
    assert main(["eval", str(config), str(drafter), "--suite", f"arc={tmp_path / 'arc.jsonl'}"]) == 2
    line = one_error_line(capsys)
    assert "unknown suite 'arc'; the known suites are gsm8k, math500, humaneval, mbpp, mtbench, alpaca" in line


def test_each_suite_builds_its_prompt_from_the_published_format(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    rows = {
        "gsm8k": [{"question": "How many?", "answer": "#### 3"}],
        "math500": [{"problem": "Solve x+1=2.", "solution": "x=1", "answer": "1", "unique_id": "test/algebra/1.json"}],
        "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "test": "",
                       "entry_point": "add", "canonical_solution": "    return a + b\n"}],
        "mbpp": [{"task_id": 2, "text": "Write a function to add.", "code": "", "test_list": []},
                 {"task_id": 3, "prompt": "Write a function to sub.", "code": "", "test_list": []}],
        "mtbench": [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
                    {"prompt_id": 7, "category": "coding", "prompt": ["Write code.", "Faster."]}],
        "alpaca": [{"instruction": "Translate.", "input": "bonjour", "output": "hello"},
                   {"instruction": "Say hi.", "input": "", "output": "hi"}],
    }
    expected = {
        "gsm8k": [("gsm8k:1", [f"How many?\n{MATH_INSTRUCTION}"])],
        "math500": [("math500:test/algebra/1.json", [f"Solve x+1=2.\n{MATH_INSTRUCTION}"])],
        "humaneval": [("humaneval:HumanEval/0",
                       [f"{HUMANEVAL_INSTRUCTION}\n```python\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n\n```"])],
        "mbpp": [("mbpp:2", ["Write a function to add."]), ("mbpp:3", ["Write a function to sub."])],
        "mtbench": [("mtbench:81", ["Write a poem.", "Shorter."]), ("mtbench:7", ["Write code.", "Faster."])],
        "alpaca": [("alpaca:1", ["Translate.\n\nInput:\nbonjour"]), ("alpaca:2", ["Say hi."])],
    }
    assert set(rows) == set(SUITES)
    for name, suite_rows in rows.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", suite_rows)
        assert read_suite(name, str(path), 80) == expected[name], name
    parquet = tmp_path / "math500.parquet"
    pq.write_table(pa.Table.from_pylist(rows["math500"] * 3), parquet)
    assert read_suite("math500", str(parquet), 2) == expected["math500"] * 2
    pq.write_table(pa.Table.from_pylist([{"question": "ok"}, {"question": ""}]), parquet)
    with pytest.raises(BadInput, match=rf"{parquet}: row 2: a gsm8k row needs a non-empty string 'question'"):
        read_suite("gsm8k", str(parquet), 80)
    assert parse_suites(["gsm8k=a.jsonl, mtbench=hf:HuggingFaceH4/mt_bench_prompts", "alpaca=b.parquet"]) == [
        ("gsm8k", "a.jsonl"), ("mtbench", "hf:HuggingFaceH4/mt_bench_prompts"), ("alpaca", "b.parquet")]
    with pytest.raises(BadInput, match="names 'gsm8k' twice"):
        parse_suites(["gsm8k=a.jsonl", "gsm8k=b.jsonl"])
    with pytest.raises(BadInput, match="no installed package ships alpaca; give alpaca=PATH"):
        parse_suites(["alpaca"])
