"""What bench.run hands every section: where the repository is, a scratch folder, and the run's options."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


@dataclass(frozen=True)
class BenchContext:
    run_dir: Path
    """This section's scratch folder (logs, raw per-step records) under bench/.runs/, which git ignores."""
    rounds: int | None = None
    """Override of how many alternating rounds a section runs (None: the section's default)."""
    quick: bool = False
    """`--quick`: a section may also run fewer steps or smaller sizes (its rows then say so)."""
    cases: tuple[str, ...] = ()
    """`--case`: run only these of a section's cases (a section that has cases names them; empty: all). Only
    the rows it then returns replace their namesakes in results.json; the section's other rows stay."""

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
