"""The docs stay reference a reader can scan: no line of README.md or docs/*.md over 400 characters outside code
blocks (a table row that long is a paragraph in a cell: make it a list), and every relative link names a file
that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT = 400


def _prose_lines(path: Path):
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def test_no_doc_line_is_over_400_characters():
    long = [f"{p.relative_to(ROOT)}:{n} ({len(line)} characters): {line[:80]}..."
            for p in DOCS for n, line in _prose_lines(p) if len(line) > LIMIT]
    assert not long, "lines over 400 characters outside code blocks:\n" + "\n".join(long)


def test_relative_links_name_files_that_exist():
    broken = []
    for p in DOCS:
        for n, line in _prose_lines(p):
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                if not (p.parent / target).exists():
                    broken.append(f"{p.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
