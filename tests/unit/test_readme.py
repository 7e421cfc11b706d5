"""README's commands run as written, and the pages it links to exist.

A block is runnable when the line before its fence is `<!-- runnable -->` (an HTML comment, so it does not
show on GitHub) and the fence is ```` ```bash ````:

    <!-- runnable -->
    ```bash
    trainyard plan examples/demo.yaml
    ```

Each runnable block runs with `bash -euo pipefail` (so every command must succeed), in the order README lists
them, in one fresh temporary directory that stands for the repository root (`examples/` linked in, so what a
block writes, e.g. `prepared/`, lands there), with a fresh state directory and home, and `trainyard` on PATH
running this checkout's CLI with this interpreter. Mark only what takes seconds and needs no running service
(`trainyard plan`, `trainyard prepare` on the shipped examples); blocks that submit jobs stay unmarked.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "<!-- runnable -->"


def runnable_blocks(text: str) -> list[str]:
    return re.findall(rf"^{re.escape(MARKER)}\n```bash\n(.*?)^```", text, re.M | re.S)


def test_readme_runnable_blocks_run_as_written(tmp_path):
    blocks = runnable_blocks(README.read_text())
    assert len(blocks) >= 2, f"README should mark its cheap commands with {MARKER}"
    work, bin_dir = tmp_path / "checkout", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    shim = bin_dir / "trainyard"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainyard.cli.main "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           "HOME": str(tmp_path / "home"), "TRAINYARD_STATE_DIR": str(tmp_path / "state")}
    for key in ("TRAINYARD_URL", "TRAINYARD_TOKEN"):
        env.pop(key, None)
    for block in blocks:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, f"README block failed ({done.returncode}):\n{block}\n{done.stdout}\n{done.stderr}"


def test_runnable_marker_is_recognised_only_before_a_bash_fence():
    text = f"{MARKER}\n```bash\ntrainyard --help\n```\n\n```bash\ntrainyard serve\n```\n{MARKER}\n```yaml\na: 1\n```\n"
    assert runnable_blocks(text) == ["trainyard --help\n"]


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, spaces to '-', other punctuation but '-' and '_' dropped."""
    return {"".join(c for c in title.strip().lower().replace(" ", "-") if c.isalnum() or c in "-_")
            for title in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_readme_and_docs_link_only_to_files_and_headings_in_the_repository():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve() if target else page  # `(#heading)`: this page's
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []
