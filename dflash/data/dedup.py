"""Is a training prompt a copy of a benchmark row? Exact and near-duplicate matching against the eval suites.

Texts are compared after `normalize`: Unicode NFKC, lower case, every run of characters that are not letters or
digits (punctuation, LaTeX markup, whitespace) made one space; so `$x^2+1$` and `$x^2 + 1$` are the same text.
A prompt is a duplicate of an eval text when

* **exact**: the normalised texts are equal, or the eval text appears whole inside the prompt (the same problem
  with an instruction appended, or a question quoted in a passage);
* **near**, one of (numbers count as one and the same word here: the same exercise with other numbers is a near
  duplicate):
  - *one word*: the eval text has `ONE_WORD_MIN` to `ONE_WORD_MAX` words and the prompt is the same text, or
    that text with one word substituted, inserted or removed ("Write a rust function to ..." for MBPP's
    "Write a python function to ...");
  - *shingles*: they share `NEAR_SHARE` (40%) or more of the 4-word shingles of the shorter of the two, and
    `MIN_SHARED` or more of them (8 words or more in common);
  - *run*: the prompt repeats `LONG_RUN` (20) or more consecutive words of the eval text.

Stock phrases do not count: a shingle found in `STOCK` or more different texts (of the eval texts and of the
prompts of the task being checked) is a template's wording ("enter the letter of the correct option", "write a
python function to", the `[asy]` preamble of MATH's graphs), which prompts of one template share without
copying each other. It is left out of both texts before shares and runs are counted.

Why these numbers. One changed word removes at most 4 shingles: a 40-word text (37 shingles) with three words
changed keeps at least 25 (68%), a 20-word one with two changed at least 9 of 17 (53%). Measured on the suites'
own texts with words replaced at random, the rule finds 94% of the 20-to-30-word texts with three words
replaced and all longer ones with four; below 20 words two replaced words make another task as often as a copy
("the maximum of two numbers", "the minimum of three numbers"), so there one word's difference is the rule.
Unrelated texts of one kind share stock phrases but few of their other 4-grams; the near matches the pool's
data sets give (docs/evaluation.md) are the same exercise with other numbers or names, and a few close
variants of one. Counting the shorter text's shingles, not the union's, catches a copy with text around it (a
passage, an instruction). Eight words in common keeps a short question that names a title ("harry potter and
the philosopher's stone") from matching a long eval text that quotes it. Twenty consecutive words is a copied
sentence and a half. An eval text of under `ONE_WORD_MIN` (6) words matches only whole (equal or contained):
"Compute $\\dbinom{31}{28}$." is not a copy of "Compute $\\dbinom{8}{4}$.".

`EvalIndex` holds the eval texts: for GSM8K the question, for MATH-500 the problem, for HumanEval the prompt and
its docstring, for MBPP the task text, for MT-Bench each of the two turns. Inverted indexes (shingle -> eval
texts; text less one word -> eval texts) make `check` touch only the eval texts that could match.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

SHINGLE = 4  # words per shingle
NEAR_SHARE = 0.4  # shared shingles / shingles of the shorter text
MIN_SHARED = 5  # and at least this many shared shingles (8 words or more in common)
LONG_RUN = 20  # or this many consecutive words of the eval text repeated
ONE_WORD_MIN, ONE_WORD_MAX = 6, 20  # eval texts of these lengths (words) also match at one word's difference
STOCK = 4  # a shingle found in this many different texts is a stock phrase

NOT_WORD = re.compile(r"[\W_]+")
NUMBER = re.compile(r"\d+")
DOCSTRING = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', re.S)


def normalize(text: str) -> str:
    """NFKC, lower case, runs of non-alphanumerics as one space, stripped."""
    text = text if text.isascii() else unicodedata.normalize("NFKC", text)
    return NOT_WORD.sub(" ", text.lower()).strip()


def masked_words(norm: str) -> tuple[str, ...]:
    """The words of a normalised text with every number made `0`, for near matching."""
    return tuple(NUMBER.sub("0", norm).split())


def shingle_list(words: tuple[str, ...]) -> list[int]:
    """The hashes of the text's word 4-grams, in order (none for texts of fewer than 4 words)."""
    return list(map(hash, zip(*(words[i:] for i in range(SHINGLE)), strict=False)))


def one_word_less(words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The text with each one of its words removed, in order."""
    return [words[:i] + words[i + 1:] for i in range(len(words))]


@dataclass(frozen=True)
class Prompt:
    """A text prepared for matching: normalised, its words with numbers masked, its shingles in order."""

    norm: str
    words: tuple[str, ...]
    order: list[int]

    @classmethod
    def of(cls, text: str) -> Prompt:
        norm = normalize(text)
        words = masked_words(norm)
        return cls(norm, words, shingle_list(words))


@dataclass(frozen=True)
class EvalText:
    suite: str  # gsm8k, math500, humaneval, mbpp, mtbench
    row_id: str  # the row's own id (or its row number)
    field: str  # which text of the row: question, problem, prompt, docstring, text, turn 1, turn 2
    text: str


@dataclass(frozen=True)
class Match:
    kind: str  # "exact" or "near"
    rule: str  # exact: "equal", "contained"; near: "one word", "shingles", "run"
    eval: EvalText
    share: float  # shared shingles / shingles of the shorter text, stock phrases left out (1.0: exact)
    run: int  # the longest run of consecutive words of the eval text that the prompt repeats

    def describe(self) -> str:
        return (f"{self.kind} duplicate ({self.rule}) of {self.eval.suite}:{self.eval.row_id} {self.eval.field}: "
                f"{self.share:.0%} of shingles shared, {self.run} words in a row")


def suite_texts(name: str, rows: Iterable[dict[str, Any]]) -> Iterator[EvalText]:
    """The texts of a suite's rows that a training prompt must not copy."""
    def field_of(row: dict[str, Any], *keys: str) -> str:
        return next((row[k] for k in keys if isinstance(row.get(k), str) and row[k].strip()), "")

    for number, row in enumerate(rows, 1):
        text = partial(field_of, row)
        if name == "gsm8k":
            yield EvalText(name, str(row.get("id", number)), "question", text("question"))
        elif name == "math500":
            yield EvalText(name, str(row.get("unique_id", row.get("index", number))), "problem", text("problem"))
        elif name == "humaneval":
            row_id, prompt = str(row.get("task_id", number)), text("prompt")
            yield EvalText(name, row_id, "prompt", prompt)
            for a, b in DOCSTRING.findall(prompt):
                yield EvalText(name, row_id, "docstring", a or b)
        elif name == "mbpp":
            yield EvalText(name, str(row.get("task_id", number)), "text", text("prompt", "text"))
        elif name == "mtbench":
            turns = row.get("turns", row.get("prompt")) or []
            for i, turn in enumerate(turns[:2]):
                if isinstance(turn, str):
                    yield EvalText(name, str(row.get("question_id", number)), f"turn {i + 1}", turn)
        else:
            raise ValueError(f"no texts known for suite '{name}'")


class EvalIndex:
    """Every eval text, normalised, with the indexes `check` looks candidates up in."""

    def __init__(self, texts: Iterable[EvalText]):
        self.texts: list[EvalText] = []
        self.norms: list[str] = []
        self.shingles: list[frozenset[int]] = []
        self.equal: dict[str, int] = {}  # normalised text -> eval text
        self.postings: dict[int, list[int]] = {}  # shingle -> eval texts holding it
        self.whole: dict[tuple[str, ...], int] = {}  # short texts' words -> eval text
        self.less_one: dict[tuple[str, ...], int] = {}  # short texts less one word -> eval text
        self.df: Counter[int] = Counter()  # shingle -> different eval texts holding it
        self.starts: dict[int, list[int]] = {}  # first shingle -> eval texts (containment candidates)
        self.short: list[int] = []  # eval texts of fewer words than a shingle
        for item in texts:
            norm = normalize(item.text)
            if not norm or norm in self.equal:
                continue
            i = len(self.texts)
            words = masked_words(norm)
            self.texts.append(item)
            self.norms.append(norm)
            self.shingles.append(frozenset(shingle_list(words)))
            self.equal[norm] = i
            self.df.update(self.shingles[i])
            first = shingle_list(words[:SHINGLE])
            if first:
                self.starts.setdefault(first[0], []).append(i)
            else:
                self.short.append(i)
            for s in self.shingles[i]:
                self.postings.setdefault(s, []).append(i)
            if ONE_WORD_MIN <= len(words) <= ONE_WORD_MAX:
                self.whole.setdefault(words, i)
                for key in one_word_less(words):
                    self.less_one.setdefault(key, i)
        self.any_shingle = frozenset(self.postings)
        self.any_start = frozenset(self.starts)
        self.eval_stock = frozenset(s for s, n in self.df.items() if n >= STOCK)

    @classmethod
    def from_suites(cls, names: Iterable[str] | None = None) -> EvalIndex:
        """The index of the packaged suites (dflash.data.benchmarks): all five unless `names` picks some."""
        from dflash.data.benchmarks import PACKAGED_SUITES, packaged_rows

        chosen = list(PACKAGED_SUITES) if names is None else list(names)
        return cls(t for name in chosen for t in suite_texts(name, packaged_rows(name)))

    def __len__(self) -> int:
        return len(self.texts)

    def stock(self, prompts: Iterable[Prompt]) -> frozenset[int]:
        """The stock phrases of the eval texts and of `prompts` (those of one task): shingles found in `STOCK`
        or more different texts."""
        df: Counter[int] = Counter()
        for order in {p.norm: p.order for p in prompts if p.norm not in self.equal}.values():
            df.update(set(order))
        both = {s for s in df.keys() & self.df.keys() if df[s] + self.df[s] >= STOCK}
        return self.eval_stock | both | {s for s, n in df.items() if n >= STOCK}

    def match(self, text: str, stock: frozenset[int] | None = None) -> Match | None:
        """The eval text this prompt copies (an exact match first, else the nearest near one), or None."""
        return self.check(Prompt.of(text), stock)[0]

    def check(self, prompt: Prompt, stock: frozenset[int] | None = None) -> tuple[Match | None, float]:
        """(the match or None, the largest shingle share with an eval text it shares `MIN_SHARED` shingles with:
        how close the prompt came to the near threshold). `stock`: the stock phrases of the prompt's task
        (`stock()`), by default the eval texts' own."""
        stock = self.eval_stock if stock is None else stock
        norm, words, order = prompt.norm, prompt.words, prompt.order
        hit = self.equal.get(norm)
        if hit is not None:
            return Match("exact", "equal", self.texts[hit], 1.0, len(norm.split())), 1.0
        padded = f" {norm} "
        starting = [i for s in set(order) & self.any_start for i in self.starts[s]]
        for i in sorted(starting + self.short, key=lambda i: (-len(self.norms[i]), i)):  # the longest first
            if f" {self.norms[i]} " in padded:
                return Match("exact", "contained", self.texts[i], 1.0, len(self.norms[i].split())), 1.0
        mine = set(order) - stock
        counts = Counter(i for s in mine & self.any_shingle for i in self.postings[s])
        best: Match | None = None
        nearest = 0.0
        for i, shared in sorted(counts.items()):  # in index order: ties resolve the same way in every process
            if shared < MIN_SHARED:
                continue
            theirs = self.shingles[i] - stock
            share = shared / min(len(mine), len(theirs))
            nearest = max(nearest, share)
            run = longest_run(order, theirs)
            rule = "shingles" if share >= NEAR_SHARE else "run" if run >= LONG_RUN else ""
            if rule and (best is None or (share, run) > (best.share, best.run)):
                best = Match("near", rule, self.texts[i], share, run)
        if best is None and ONE_WORD_MIN - 1 <= len(words) <= ONE_WORD_MAX + 1:
            i = self.one_word(words)
            if i is not None:
                theirs = self.shingles[i] - stock
                share = len(mine & theirs) / min(len(mine), len(theirs)) if mine and theirs else 0.0
                best = Match("near", "one word", self.texts[i], share, longest_run(order, theirs))
        return best, (1.0 if best else nearest)

    def one_word(self, words: tuple[str, ...]) -> int | None:
        """An eval text these words equal, or are one word away from (substituted, inserted or removed)."""
        for found in (self.whole.get(words), self.less_one.get(words)):  # equal; the prompt lacks a word
            if found is not None:
                return found
        for key in one_word_less(words):
            found = self.whole.get(key, self.less_one.get(key))  # the prompt has one word more; one substituted
            if found is not None:
                return found
        return None


@functools.cache
def suite_index() -> EvalIndex:
    """The index of the five packaged suites, built once per process (their files do not change under it)."""
    return EvalIndex.from_suites()


def longest_run(order: list[int], theirs: frozenset[int]) -> int:
    """The most consecutive words of the prompt covered by consecutive shingles in `theirs` (0 if none)."""
    best = run = 0
    for s in order:
        run = run + 1 if s in theirs else 0
        best = max(best, run)
    return best + SHINGLE - 1 if best else 0


__all__ = ["LONG_RUN", "MIN_SHARED", "NEAR_SHARE", "ONE_WORD_MAX", "ONE_WORD_MIN", "SHINGLE", "STOCK", "EvalIndex",
           "EvalText", "Match", "Prompt", "normalize", "suite_index",
           "suite_texts"]
