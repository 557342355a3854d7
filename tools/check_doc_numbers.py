"""Check that the numbers the docs quote from benchmark results are in the results they cite.

    python tools/check_doc_numbers.py            # README.md and docs/*.md; exit 1 and a list on a mismatch

A docs "unit" is a paragraph, a list item or a table row (fenced code blocks are skipped). When a unit
names a results file (`benchmarks/results/<name>_<yyyy-mm-dd>.<ext>`), every number written in its prose
must appear in one of the files it names; numbers inside `code spans`, link targets, file names and
ISO dates are not quoted results and are skipped. A unit citing a file that does not exist, or whose name
carries no date, fails too. Numbers compare as written ("0.10" is not found in "0.104"), so a rounded
or stale figure is caught, and the fix is to quote the file.
"""

from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CITATION = re.compile(r"benchmarks/results/[A-Za-z0-9_.\-]*[A-Za-z0-9]")
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")
# A number not inside a word (Qwen2, fp32, x8) or a longer number; a unit may follow (2.22x, 152s, 0.5B).
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?![\d,.]?\d)")
# Prose that is not a quoted figure: code spans, link targets, dates.
NOT_PROSE = [re.compile(r"`[^`]*`"), re.compile(r"\]\([^)]*\)"), DATED]
ITEM_START = re.compile(r"^\s*(?:[*-] |\| |\d+\. )")


def doc_files(root: str = ROOT) -> list[str]:
    """README.md and every markdown file under docs/."""
    files = [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
    )
    return [f for f in files if os.path.isfile(f)]


def units(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item and table row outside fenced code."""
    out: list[tuple[int, str]] = []
    cur: list[str] = []
    start = 0
    fenced = False

    def flush():
        if cur:
            out.append((start, "\n".join(cur)))
            cur.clear()

    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line.strip() or ITEM_START.match(line) or line.startswith("#"):
            flush()
        if line.strip():
            if not cur:
                start = n
            cur.append(line)
    flush()
    return out


def quoted_numbers(unit: str) -> list[str]:
    """The numbers written in the unit's prose (see NOT_PROSE for what is skipped)."""
    prose = CITATION.sub(" ", unit)
    for pattern in NOT_PROSE:
        prose = pattern.sub(" ", prose)
    return NUMBER.findall(prose)


def found_in(number: str, text: str) -> bool:
    """`number` written in `text` as a whole number (with or without its thousands separators)."""
    for form in {number, number.replace(",", "")}:
        if re.search(r"(?<![\d.])" + re.escape(form) + r"(?![\d])", text):
            return True
    return False


def check_file(path: str, root: str = ROOT) -> list[str]:
    """One line per problem in the doc at `path`: a missing or undated citation, or a number not found."""
    problems = []
    rel = os.path.relpath(path, root)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    cache: dict[str, str] = {}
    for line, unit in units(text):
        cited = sorted(set(CITATION.findall(unit)))
        if not cited:
            continue
        sources = []
        for c in cited:
            full = os.path.join(root, c)
            if not os.path.isfile(full):
                problems.append(f"{rel}:{line}: cites {c}, which does not exist")
                continue
            if not DATED.search(os.path.basename(c)):
                problems.append(f"{rel}:{line}: cites {c}, whose name has no date (yyyy-mm-dd)")
            if c not in cache:
                with open(full, encoding="utf-8", errors="replace") as f:
                    cache[c] = f.read()
            sources.append(cache[c])
        if not sources:
            continue
        for number in quoted_numbers(unit):
            if not any(found_in(number, s) for s in sources):
                problems.append(f"{rel}:{line}: {number} is not in {', '.join(cited)}")
    return problems


def check(root: str = ROOT) -> list[str]:
    """Every problem in README.md and docs/ under `root`."""
    return [p for path in doc_files(root) for p in check_file(path, root)]


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    if problems:
        print(
            f"{len(problems)} number(s) not found in the results they cite: quote the results file, or cite the one "
            "that holds the number"
        )
        return 1
    print("every number in a paragraph citing benchmarks/results/ is in the file it cites")
    return 0


if __name__ == "__main__":
    sys.exit(main())
