"""trainyard: a Ray-based training service (see README.md and docs/design.md).

The product's four folders stay at the top of the checkout (`api/`, `service/`, `actors/`, `parallel/`) and are
this package's subpackages: `trainyard.parallel` is `parallel/`. Installed, `setup.py` maps each folder under
`trainyard/` in site-packages, so nothing but `trainyard` lands at the top level. Run from a checkout (tests,
`make demo`, a worktree on PYTHONPATH), this file adds the checkout's root to the package's search path, so the
same imports find the checkout's folders.
"""

from pathlib import Path

_here = Path(__file__).resolve().parent
if not (_here / "parallel").is_dir() and (_here.parent / "parallel" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821 (a package's __path__ is defined by the import system)
