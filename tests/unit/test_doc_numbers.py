"""The docs quote benchmark numbers from the dated results files they cite (tools/check_doc_numbers.py).

Catches: a stale or mistyped figure in README.md or docs/ next to a `benchmarks/results/...` citation
(the demo's time, a speed-up, a plan total), a citation of a results file that does not exist or has no
date in its name, and a checker that stops looking (a planted wrong number must be reported).
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("check_doc_numbers", os.path.join(ROOT, "tools", "check_doc_numbers.py"))
check_doc_numbers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_doc_numbers)


def _repo(
    tmp_path,
    doc: str,
    results: str = "reward 0.998 in 152 s over 2,096 prompts\n",
    name: str = "demo_cpu_2026-11-25.md",
):
    """A miniature repository: one results file and a README quoting it."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / name).write_text(results)
    (tmp_path / "README.md").write_text(doc)
    return str(tmp_path)


def test_the_repository_docs_quote_their_results_files():
    assert check_doc_numbers.check() == []


def test_a_planted_wrong_number_is_reported(tmp_path):
    ok = "The demo reached 0.998 in 152 s on 2,096 prompts (`benchmarks/results/demo_cpu_2026-11-25.md`).\n"
    assert check_doc_numbers.check(_repo(tmp_path, ok)) == []
    for wrong in ("107 s", "0.99 in", "2,097"):
        (tmp_path / "README.md").write_text(
            ok.replace({"107 s": "152 s", "0.99 in": "0.998 in", "2,097": "2,096"}[wrong], wrong)
        )
        problems = check_doc_numbers.check(str(tmp_path))
        assert len(problems) == 1 and wrong.split()[0] in problems[0], (wrong, problems)


def test_a_number_in_a_later_line_of_the_paragraph_or_a_table_row_is_checked(tmp_path):
    doc = (
        "First line of a paragraph,\nsecond line says 63 s (benchmarks/results/demo_cpu_2026-11-25.md).\n\n"
        "| run | s |\n|---|---|\n| demo, `benchmarks/results/demo_cpu_2026-11-25.md` | 151 |\n"
    )
    problems = check_doc_numbers.check(_repo(tmp_path, doc))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "63 is not in benchmarks/results/demo_cpu_2026-11-25.md",
        "151 is not in benchmarks/results/demo_cpu_2026-11-25.md",
    ]


def test_code_spans_dates_and_uncited_paragraphs_are_not_quotes(tmp_path):
    doc = (
        "Run `trainer.total_steps=40` on 2026-11-25: 152 s (benchmarks/results/demo_cpu_2026-11-25.md).\n\n"
        "A paragraph without a citation may say 999.\n\n```\n12345 (benchmarks/results/demo_cpu_2026-11-25.md)\n```\n"
    )
    assert check_doc_numbers.check(_repo(tmp_path, doc)) == []


def test_a_missing_or_undated_results_file_is_reported(tmp_path):
    doc = "152 s (benchmarks/results/demo_cpu.md) and (benchmarks/results/gone_2026-01-01.md).\n"
    root = _repo(tmp_path, doc, name="demo_cpu.md")
    problems = check_doc_numbers.check(root)
    assert any("gone_2026-01-01.md, which does not exist" in p for p in problems)
    assert any("demo_cpu.md, whose name has no date" in p for p in problems)


def test_docs_directory_files_are_checked(tmp_path):
    root = _repo(tmp_path, "no citations here\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "speed.md").write_text("2.22x (benchmarks/results/demo_cpu_2026-11-25.md)\n")
    assert check_doc_numbers.check(root) == [
        "docs/speed.md:1: 2.22 is not in benchmarks/results/demo_cpu_2026-11-25.md"
    ]
