"""The rooms' import rules (docs/design.md), read from the source: every import counts, wherever it sits
(function bodies and TYPE_CHECKING blocks are dependencies all the same).

- The product's folders: `service/` and `actors/` never import `api/` or `cli/`; `parallel/` imports no Ray,
  FastAPI, service, actors, api or cli; `api/` touches neither Ray nor torch.
- `parallel/`'s rooms: `config`, `seeds`, `spec`, `names` at its top import no room; then each room imports only the
  rooms below it (`ROOMS`; a room's own rooms, `runtime/dp/`, `models/components/`..., count as it), and nothing in
  `parallel/` imports a circle.
- Rooms inside rooms: in every folder of the product, its rooms import each other without a circle (counted room by
  room, not module by module). `runtime/`'s rooms import only the rooms `RUNTIME_ROOMS` lists and never the modules
  at `runtime/`'s top, which assemble them; `models/components/` imports no family. Each room's `__init__.py` has a
  docstring (what it owns).
- `actors/`: nothing imports a circle (the controller's parts in `actions/`, the policies, the worker group: none
  imports the controller back) and only the coordinator imports the controller.
- No folder of the product holds over 15 modules, nor any module over 400 lines.
- `plan/` loads without torch, and so do the coordinator and the service.
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("api", "service", "actors", "parallel", "cli")

ROOMS: dict[str, set[str]] = {
    "models": set(),
    "optim": set(),
    "plan": {"models", "optim"},
    "data": {"plan", "models", "optim"},
    "io": {"plan", "models", "optim"},
    "runtime": {"plan", "models", "optim", "data", "io"},
}
"""Each room of `parallel/` -> the rooms it may import (besides itself and the top: config, seeds, spec)."""

RUNTIME_ROOMS: dict[str, set[str]] = {
    "tp": set(),
    "dp": {"tp"},
    "compression": {"dp", "tp"},
    "sync": set(),
    "pipeline": {"dp", "tp"},
    "step": {"pipeline"},
    "sampling": set(),
    "cp": set(),
    "tinker": {"sampling", "tp"},
}
"""Each room of `parallel/runtime/` -> the runtime rooms it may import (besides itself). None imports the modules at
`runtime/`'s top (driver, trainer, build, rank_state...): they assemble the rooms."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "service": ("api", "cli"),
    "actors": ("api", "cli", "service"),
    "parallel": ("ray", "fastapi", "uvicorn", "api", "service", "actors", "cli"),
    "api": ("ray", "torch", "cli", "actors"),
}
"""A product folder -> the top-level packages (ours without the `trainyard.` prefix, or a library) it never imports."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once for all the tests' graphs
def _imported_names(path: Path) -> frozenset[str]:
    """Every dotted name `path` imports, ours without the `trainyard.` prefix, relative imports resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found |= {n.removeprefix("trainyard.") for n in names}
    return frozenset(found)


def product_files() -> dict[str, Path]:
    return {_module_name(p): p for top in PRODUCT for p in (ROOT / top).rglob("*.py")}


def import_graph(top: str = "parallel") -> dict[str, set[str]]:
    """Module -> the modules of `top` it imports (`from parallel.x import f` counts as parallel.x)."""
    files = {name: path for name, path in product_files().items() if name.split(".")[0] == top}
    graph = {}
    for name, path in files.items():
        deps = set()
        for imported in _imported_names(path):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != top:
                deps.add(imported)
        graph[name] = deps - {name}
    return graph


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


def room_of(module: str) -> str | None:
    """`parallel.plan.memory.estimate` -> `plan`; None for the top of `parallel/` (the config package, names, seeds,
    spec, the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROOMS else None


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        mine = room_of(module)
        for dep in sorted(deps):
            theirs = room_of(dep)
            if theirs is None or theirs == mine:
                continue
            if mine is None or theirs not in ROOMS[mine]:
                out.append(f"{module} -> {dep} ({mine or 'the top'} may not import {theirs})")
    return out


def test_parallel_modules_import_each_other_without_a_circle():
    graph = import_graph()
    assert "parallel.plan.memory.estimate" in graph["parallel.plan.admission"]  # the walk sees imports at all
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_room_of_parallel_imports_only_the_rooms_below_it():
    graph = import_graph()
    # every package of parallel/ is a room, but the JobSpec's (`config`), which sits at the top with names, seeds, spec
    assert set(ROOMS) | {"config"} == {p.name for p in (ROOT / "parallel").iterdir() if (p / "__init__.py").is_file()}
    assert room_violations(graph) == []


def test_actors_modules_import_each_other_without_a_circle():
    graph = import_graph("actors")
    assert "actors.actions.recovery" in graph["actors.controller"]  # the walk sees the sub-rooms' modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_only_the_coordinator_imports_the_controller():
    """The controller's parts talk to it through what it hands them, not by importing it (TYPE_CHECKING too)."""
    graph = import_graph("actors")
    assert sorted(module for module, deps in graph.items() if "actors.controller" in deps) == ["actors.coordinator"]


@functools.cache
def rooms_in(folder: str) -> list[str]:
    """The rooms directly inside a folder of the product (`parallel/runtime` -> compression, dp, ...): its packages."""
    return sorted(p.name for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file())


def room_inside(module: str, folder: str) -> str | None:
    """`parallel.runtime.dp.data_parallel`, `parallel/runtime` -> `dp`; None for a module at the folder's top (or
    outside the folder)."""
    prefix = folder.replace("/", ".") + "."
    first = module.removeprefix(prefix).split(".")[0] if module.startswith(prefix) else None
    return first if first in rooms_in(folder) else None


def room_graph(folder: str) -> dict[str, set[str]]:
    """The rooms directly inside `folder` -> the other rooms of it their modules import (its top's modules left out:
    they are no room)."""
    graph: dict[str, set[str]] = {r: set() for r in rooms_in(folder)}
    for module, deps in import_graph(folder.split("/")[0]).items():
        if (mine := room_inside(module, folder)) is not None:
            graph[mine] |= {theirs for dep in deps if (theirs := room_inside(dep, folder)) not in (None, mine)}
    return graph


def product_folders() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT)) for top in PRODUCT for p in (ROOT / top).rglob("__init__.py"))


def test_the_rooms_inside_every_folder_import_each_other_without_a_circle():
    graphs = {folder: room_graph(folder) for folder in product_folders()}
    assert "tp" in graphs["parallel/runtime"]["dp"]  # the walk sees the rooms inside rooms
    assert "components" in graphs["parallel/models"]["llama"]
    assert {folder: cycle for folder, graph in graphs.items() if (cycle := find_cycle(graph))} == {}


def runtime_room_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        if (mine := room_inside(module, "parallel/runtime")) is None:
            continue  # the runtime's top, which may import every room, or another room of parallel/
        for dep in sorted(deps):
            if not (dep + ".").startswith("parallel.runtime."):
                continue
            theirs = room_inside(dep, "parallel/runtime")
            if theirs is None:
                out.append(f"{module} -> {dep} ({mine} may not import the runtime's top)")
            elif theirs != mine and theirs not in RUNTIME_ROOMS.get(mine, set()):
                out.append(f"{module} -> {dep} ({mine} may not import {theirs})")
    return out


def test_every_room_of_the_runtime_imports_only_the_rooms_below_it_and_never_its_top():
    assert set(RUNTIME_ROOMS) == set(rooms_in("parallel/runtime"))
    graph = import_graph()
    assert "parallel.runtime.dp.data_parallel" in graph["parallel.runtime.build"]  # the walk sees the rooms
    assert runtime_room_violations(graph) == []


def test_the_runtime_rule_finds_an_upward_import():
    assert runtime_room_violations({"parallel.runtime.tp.local_parts": {"parallel.runtime.dp.grad_buckets"},
                                    "parallel.runtime.sync": {"parallel.runtime.rank_state"},
                                    "parallel.runtime.trainer": {"parallel.runtime.step.step_stats"}}) == [
        "parallel.runtime.sync -> parallel.runtime.rank_state (sync may not import the runtime's top)",
        "parallel.runtime.tp.local_parts -> parallel.runtime.dp.grad_buckets (tp may not import dp)",
    ]


def test_the_families_shared_parts_import_no_family():
    families = set(rooms_in("parallel/models")) - {"components"}
    graph = import_graph()
    bad = [f"{module} -> {dep}" for module, deps in sorted(graph.items())
           if room_inside(module, "parallel/models") == "components"
           for dep in sorted(deps) if room_inside(dep, "parallel/models") in families]
    assert "parallel.models.components.decoder" in graph["parallel.models.llama.model"]
    assert bad == []


def test_every_room_says_what_it_owns():
    """Each folder inside a product folder (a room) has an `__init__.py` with a docstring."""
    silent = [folder for folder in product_folders() if "/" in folder
              and not ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))]
    assert silent == []


MODULES_PER_FOLDER, LINES_PER_MODULE = 15, 400


def test_no_folder_of_the_product_is_crowded_and_no_module_is_long():
    """Modules are the `.py` files directly in a folder, `__init__` too."""
    folders: dict[str, int] = {}
    long = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            folder = str(path.parent.relative_to(ROOT))
            folders[folder] = folders.get(folder, 0) + 1
            if (lines := len(path.read_text().splitlines())) > LINES_PER_MODULE:
                long[str(path.relative_to(ROOT))] = lines
    assert {folder: n for folder, n in folders.items() if n > MODULES_PER_FOLDER} == {}
    assert long == {}


def test_the_room_rule_finds_an_upward_import():
    assert room_violations({"parallel.plan.memory.estimate": {"parallel.runtime.trainer", "parallel.models.base"},
                            "parallel.config": {"parallel.plan.layout"}}) == [
        "parallel.config -> parallel.plan.layout (the top may not import plan)",
        "parallel.plan.memory.estimate -> parallel.runtime.trainer (plan may not import runtime)",
    ]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_product_folders_import_only_what_their_room_allows(folder):
    bad = [f"{module} imports {name}" for module, path in sorted(product_files().items())
           if module.split(".")[0] == folder
           for name in sorted(_imported_names(path)) if name.split(".")[0] in FORBIDDEN[folder]]
    assert bad == []


def test_the_plan_loads_without_torch():
    """Every module of `plan/` (and the optimizer registry and model registry it reads) imports without torch."""
    modules = sorted(m for m in product_files() if m.startswith("parallel.plan"))
    code = (f"import sys, importlib; [importlib.import_module('trainyard.' + m) for m in {modules!r}]; "
            "import trainyard.parallel.optim.kinds, trainyard.parallel.models, trainyard.parallel.spec; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert len(modules) > 10 and out.stdout.strip() == "False"


def test_the_coordinator_and_the_service_start_without_torch():
    """Every job's coordinator process imports its module as the job starts, and `trainyard serve` its service
    at every start: torch's seconds of import belong in the ranks (and in an export), not on those paths."""
    code = ("import sys; import trainyard.actors.coordinator, trainyard.service.manager, trainyard.service.server, "
            "trainyard.api.app, trainyard.cli.main; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
