"""`python -m bench.report [--check]`: BENCHMARKS.md's tables, generated from bench/results.json.

BENCHMARKS.md marks where each table goes:

    <!-- table: SECTION -->            every row of that section
    <!-- table: SECTION PREFIX -->     its rows whose name starts with PREFIX (which may hold spaces)
    <!-- /table -->                    the end of the generated block

A row goes to the table of its section with the longest prefix its name starts with, so each row is shown once.
Between the markers this writes the table and, in the section's first table, a line saying when, how long and on
which machine the rows were measured (results.json's section metadata). The prose around the markers is the
reader's; this never touches it. `--check` writes nothing and exits 1 when BENCHMARKS.md is not what this would
write, when a row of results.json has no table, or when a table has no rows: the unit test runs it, so CI fails
when the two drift apart.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.context import BENCH, REPO
from bench.results import Row, load, markdown_table

DOC = REPO / "BENCHMARKS.md"
RESULTS = BENCH / "results.json"
BLOCK = re.compile(r"<!-- table: (?P<section>[^\s>]+)(?: (?P<prefix>[^>]*?))? -->\n(?P<body>.*?)<!-- /table -->",
                   re.DOTALL)


@dataclass(frozen=True)
class Table:
    section: str
    prefix: str


def render(doc: str, results: dict[str, Any]) -> tuple[str, list[str]]:
    """`doc` with every marked table rewritten from `results`, and what is wrong (rows with no table, tables with
    no rows, markers of sections that results.json lacks)."""
    tables = [Table(m["section"], m["prefix"] or "") for m in BLOCK.finditer(doc)]
    rows = [Row.from_dict(r) for r in results.get("rows", [])]
    placed: dict[Table, list[Row]] = {t: [] for t in tables}
    problems = []
    for row in rows:
        home = _home(row, tables)
        if home is None:
            problems.append(f"row {row.name!r} of section {row.section!r} has no table in BENCHMARKS.md")
        else:
            placed[home].append(row)
    sections = results.get("sections", {})
    seen: set[str] = set()
    bodies = []
    for table in tables:
        if table.section not in sections:
            problems.append(f"table {table.section} {table.prefix!r}: results.json has no section {table.section!r}")
        if not placed[table]:
            problems.append(f"table {table.section} {table.prefix!r}: no rows")
        meta = sections.get(table.section) if table.section not in seen else None
        seen.add(table.section)
        bodies.append(_body(meta, placed[table]))
    parts = iter(bodies)

    def rewrite(m: re.Match[str]) -> str:  # the marker line kept as written, the body replaced
        return doc[m.start():m.start("body")] + next(parts) + "<!-- /table -->"

    return BLOCK.sub(rewrite, doc), problems


def _home(row: Row, tables: list[Table]) -> Table | None:
    mine = [t for t in tables if t.section == row.section and row.name.startswith(t.prefix)]
    return max(mine, key=lambda t: len(t.prefix), default=None)


def _body(meta: dict[str, Any] | None, rows: list[Row]) -> str:
    text = "" if meta is None else measured_line(meta) + "\n\n"
    return text + markdown_table(rows) + "\n"


def measured_line(meta: dict[str, Any]) -> str:
    """When and where a section ran, from its metadata in results.json."""
    when = datetime.strptime(meta["measured_at"], "%Y-%m-%dT%H:%M:%S%z").astimezone(UTC)
    load = meta.get("load")
    load_text = f"; load average {load[0]:.1f} before, {load[1]:.1f} after" if load else ""
    quick = ", `--quick`" if meta.get("quick") else ""
    m = meta["machine"]
    if "device" in m:  # a GPU session's (bench.gpu_record)
        return (f"Measured {when:%Y-%m-%d %H:%M} UTC ({meta['wall_s']:g} s of device time in its parts) on "
                f"{m['device']}; torch {m['torch']}; commit {meta['commit'][:12]}; `{meta['command']}`.")
    return (f"Measured {when:%Y-%m-%d %H:%M} UTC ({meta['wall_s']:g} s{quick}{load_text}) on {m['nproc']} cores, "
            f"{m['cpu_model']}, {m['ram_gib']} GiB RAM; torch {m['torch']}, ray {m['ray']}.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if BENCHMARKS.md is out of date")
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    doc = args.doc.read_text()
    new, problems = render(doc, load(args.results))
    for problem in problems:
        print(f"bench.report: {problem}", file=sys.stderr)
    if args.check:
        if new != doc:
            print(f"bench.report: {args.doc.name}'s tables differ from {args.results.name}: run "
                  "`python -m bench.report`", file=sys.stderr)
        return 1 if problems or new != doc else 0
    if new != doc:
        args.doc.write_text(new)
        print(f"bench.report: {args.doc} rewritten")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
