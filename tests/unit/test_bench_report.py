"""bench.report: BENCHMARKS.md's tables are generated from bench/results.json, and the check catches drift."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import main, render
from bench.results import Row, Target, markdown_table

MACHINE = {"nproc": 2, "cpu_model": "Test CPU", "ram_gib": 8.0, "python": "3.11", "torch": "2", "ray": "2",
           "os": "Linux"}
META = {"measured_at": "2026-11-27T10:00:00+0000", "wall_s": 12.0, "machine": MACHINE, "load": [1.0, 2.5]}


def _results(*rows: Row) -> dict:
    return {"machine": MACHINE, "sections": {r.section: META for r in rows}, "rows": [r.to_dict() for r in rows]}


def test_benchmarks_md_agrees_with_the_committed_results():
    assert main(["--check"]) == 0  # else: `python -m bench.report`, and commit BENCHMARKS.md with the rows


def test_check_fails_when_a_row_changes_until_the_tables_are_rewritten(tmp_path: Path):
    doc, results = tmp_path / "B.md", tmp_path / "r.json"
    doc.write_text("# B\n\n<!-- table: a -->\n<!-- /table -->\n\nprose stays\n")
    results.write_text(json.dumps(_results(Row("x", 1.0, 2.0, 0.5, "s", section="a"))))
    assert main(["--check", "--doc", str(doc), "--results", str(results)]) == 1  # the table is empty
    assert main(["--doc", str(doc), "--results", str(results)]) == 0
    assert main(["--check", "--doc", str(doc), "--results", str(results)]) == 0
    assert "| x | 1.0000 | 2.0000 | 0.500 | s |" in doc.read_text() and "prose stays" in doc.read_text()
    results.write_text(json.dumps(_results(Row("x", 1.5, 2.0, 0.75, "s", section="a"))))
    assert main(["--check", "--doc", str(doc), "--results", str(results)]) == 1


def test_each_row_lands_once_in_the_table_with_its_longest_matching_prefix():
    rows = [Row("p: summary", 0.9, None, None, "rho", section="p"), Row("p layout a", 1.0, 2.0, 0.5, "ms", section="p"),
            Row("p layout b", 3.0, 2.0, 1.5, "ms", section="p")]
    doc = "<!-- table: p -->\n<!-- /table -->\n<!-- table: p p layout -->\n<!-- /table -->\n"
    new, problems = render(doc, _results(*rows))
    assert problems == []
    summary, layouts = new.split("<!-- table: p p layout -->")
    assert "p: summary" in summary and "p layout" not in summary
    assert "p layout a" in layouts and "p layout b" in layouts and "p: summary" not in layouts
    assert "Measured 2026-11-27 10:00 UTC" in summary and "Measured" not in layouts  # once per section
    assert "load average 1.0 before, 2.5 after" in summary


def test_a_row_without_a_table_and_a_table_without_rows_are_both_problems():
    rows = [Row("x", 1.0, None, None, "s", section="a")]
    _, problems = render("<!-- table: b -->\n<!-- /table -->\n", {**_results(*rows), "sections": {"a": META,
                                                                                                   "b": META}})
    assert any("row 'x'" in p for p in problems) and any("table b" in p and "no rows" in p for p in problems)


def test_the_target_column_says_whether_the_bar_is_met():
    met = Row("fast", 1.02, 1.0, 1.02, "s", target=Target("ratio", "<=", 1.05))
    missed = Row("rho", 0.7, None, None, "rho", target=Target("ours", ">=", 0.8))
    table = markdown_table([met, missed])
    assert "| ratio <= 1.05: met |" in table and "| >= 0.8: **missed** |" in table
    assert Row.from_dict(missed.to_dict()) == missed
