"""The modules of `parallel/` import each other without a circle, and the plan loads without torch."""

import ast
import subprocess
import sys
from pathlib import Path

PARALLEL = Path(__file__).resolve().parents[2] / "parallel"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PARALLEL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every parallel module `path` imports, wherever the import sits (TYPE_CHECKING blocks and function
    bodies count: they are dependencies all the same)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in (n.removeprefix("trainyard.") for n in names):  # trainyard.parallel.x is parallel/x.py
            while name and name not in modules:  # `from parallel.x import f`: the module is parallel.x
                name = name.rpartition(".")[0]
            if name and name != "parallel":
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PARALLEL.rglob("*.py")}
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_parallel_modules_import_each_other_without_a_circle():
    graph = import_graph()
    assert "parallel.plan.memory" in graph["parallel.plan.admission"]  # the walk sees imports at all
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_plan_and_its_presentation_load_without_torch():
    code = ("import sys; import trainyard.parallel.plan, trainyard.parallel.plan.present, "
            "trainyard.parallel.plan.memory, trainyard.parallel.plan.sharding, trainyard.parallel.optim.kinds; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PARALLEL.parent)
    assert out.stdout.strip() == "False"


def test_the_coordinator_and_the_service_start_without_torch():
    """Every job's coordinator process imports its module as the job starts, and `trainyard serve` its service
    at every start: torch's seconds of import belong in the ranks (and in an export), not on those paths."""
    code = ("import sys; import trainyard.actors.coordinator, trainyard.service.manager, trainyard.service.server; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PARALLEL.parent)
    assert out.stdout.strip() == "False"
