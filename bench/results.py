"""The rows every benchmark section returns, and `bench/results.json`, which holds the latest rows of each.

A row compares one quantity between trainyard (`ours`) and a baseline: `ratio` is ours / baseline unless
the row's note says otherwise, and `baseline` is null where there is none. A baseline is always a measurement
(or the simulator's figure), never a goal: what the row should reach is its `target` (`{"of": "ours" | "ratio",
"op": "<=" | "<" | ">=", "value": x}`, null where there is none), which BENCHMARKS.md shows in a column of its
own with whether it was met. The file is
`{"machine": {...}, "sections": {name: {"measured_at", "wall_s", "machine", "scratch"}}, "rows": [...]}`
(`machine` is the latest run's); re-running some sections replaces only their rows and keeps the others'.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

DIMENSIONLESS = ("", "x", "rho")
"""Units that a figure's text leaves out."""
_OPS = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b,
        "within": lambda a, b: abs(a - 1) <= b}
"""`within`: a ratio within `value` of 1 either way (a prediction's bar: 0.05 is 5% over or under)."""


@dataclass(frozen=True)
class Target:
    """The bar a row is held to: its `of` ("ours" or "ratio") compared by `op` with `value`."""

    of: str
    op: str
    value: float

    def __post_init__(self) -> None:
        if self.of not in ("ours", "ratio") or self.op not in _OPS:
            raise ValueError(f"target: of {self.of!r} must be ours or ratio, op {self.op!r} one of {sorted(_OPS)}")

    def met(self, ours: float | None, ratio_: float | None) -> bool | None:
        """Whether the row's figure meets the bar (None: the row has no such figure)."""
        value = ours if self.of == "ours" else ratio_
        return None if value is None else _OPS[self.op](value, self.value)

    def text(self, unit: str) -> str:
        """`<= 10 s` (a bar on ours, in the row's unit) or `ratio <= 1.05`."""
        if self.of == "ratio":
            return f"ratio within {self.value:.0%} of 1" if self.op == "within" else f"ratio {self.op} {self.value:g}"
        return f"{self.op} {self.value:g}" + (f" {unit}" if unit not in DIMENSIONLESS else "")


def at_most(value: float, of: str = "ours") -> Target:
    return Target(of, "<=", value)


def at_least(value: float, of: str = "ours") -> Target:
    return Target(of, ">=", value)


def ratio_within(value: float) -> Target:
    return Target("ratio", "within", value)


@dataclass(frozen=True)
class Row:
    name: str
    ours: float | None
    baseline: float | None
    ratio: float | None
    unit: str
    note: str = ""
    section: str = ""
    """Set by bench.run from the section that produced the row."""
    target: Target | None = None
    """The bar this row is held to, apart from its baseline (None: none)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        target = data.get("target")
        return cls(**{**data, "target": Target(**target) if target else None})

    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.ours, self.ratio)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def load(path: Path) -> dict[str, Any]:
    """The results file, or an empty one."""
    if not path.exists():
        return {"machine": {}, "sections": {}, "rows": []}
    return json.loads(path.read_text())


def merge(old: dict[str, Any], rows_by_section: dict[str, list[Row]], meta_by_section: dict[str, dict[str, Any]],
          machine: dict[str, Any], order: Sequence[str], partial: bool = False) -> dict[str, Any]:
    """Replace the rows and metadata of the sections just run; keep every other section's; order by `order`.
    `partial` (some of a section's cases were run): replace only the rows of the same names."""
    def rank(section: str) -> int:
        return order.index(section) if section in order else len(order)

    fresh = {(name, r.name) for name, rows in rows_by_section.items() for r in rows}
    kept = [r for r in old.get("rows", []) if r.get("section") not in rows_by_section
            or (partial and (r.get("section"), r.get("name")) not in fresh)]
    new = [replace(r, section=name).to_dict() for name, rows in rows_by_section.items() for r in rows]
    sections = {**old.get("sections", {}), **meta_by_section}
    return {
        "machine": machine,
        "sections": {name: sections[name] for name in sorted(sections, key=rank)},
        "rows": sorted(kept + new, key=lambda r: rank(r.get("section", ""))),  # stable: keeps each section's order
    }


def save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.4f}"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def target_text(row: Row) -> str:
    """The target column: the bar and whether the row meets it ("-" where the row has none)."""
    if row.target is None:
        return "-"
    met = row.met()
    verdict = "no figure" if met is None else ("met" if met else "**missed**")
    return f"{row.target.text(row.unit)}: {verdict}"


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (readable in a terminal too), as BENCHMARKS.md shows them."""
    lines = ["| benchmark | ours | baseline | ratio | unit | target | note |", "|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        ratio_text = "-" if r.ratio is None else f"{r.ratio:.3f}"
        lines.append(f"| {r.name} | {_number(r.ours, r.unit)} | {_number(r.baseline, r.unit)} | {ratio_text} "
                     f"| {r.unit or '-'} | {target_text(r)} | {r.note} |")
    return "\n".join(lines)
