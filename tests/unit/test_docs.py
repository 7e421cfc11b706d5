"""The documentation agrees with the code: docs/jobspec.md is what `python docs/jobspec.py` writes from the
JobSpec's schema, and every field of the spec has a description to write there."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _jobspec_script():
    spec = importlib.util.spec_from_file_location("docs_jobspec", ROOT / "docs" / "jobspec.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jobspec_reference_matches_the_code():
    diff = _jobspec_script().check()
    assert diff == "", f"docs/jobspec.md is stale; run `python docs/jobspec.py`:\n{diff}"


def test_every_jobspec_field_has_a_description():
    script = _jobspec_script()
    schema = script.spec_schema()
    undocumented = [f"{section}.{name}" for section, node in [("JobConfig", schema), *schema["$defs"].items()]
                    for name, prop in node.get("properties", {}).items() if not prop.get("description")]
    assert undocumented == [], f"give these fields a docstring in parallel/config*.py: {undocumented}"


def test_jobspec_check_reports_a_stale_reference(tmp_path):
    stale = tmp_path / "jobspec.md"
    stale.write_text("# JobSpec reference\n")
    assert "+| `steps` | integer | required" in _jobspec_script().check(stale)
