"""Packaging of the product folders as subpackages of one `trainyard` namespace (see trainyard/__init__.py).

pyproject.toml holds everything else; only this mapping needs code: each folder and its subfolders become
`trainyard.<folder>...` without moving them.
"""

from setuptools import find_packages, setup

FOLDERS = ("api", "service", "actors", "parallel", "cli")

setup(
    packages=["trainyard"] + [f"trainyard.{name}" for top in FOLDERS
                              for name in (top, *(f"{top}.{sub}" for sub in find_packages(top)))],
    package_dir={"trainyard": "trainyard", **{f"trainyard.{top}": top for top in FOLDERS}},
    package_data={"trainyard.parallel.plan.planner": ["devices/*.json"]},  # the device profiles (data, not code)
)
