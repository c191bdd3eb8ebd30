"""Import layering: every module imports only its own layer or the ones below it, and no file-level cycle exists.

Layers, bottom to top (docs/architecture.md): core (rackcast/*.py: errors, strict YAML, units, ModelSpec, Plan,
layout, presets) 0, which may load a topology; topologies 1; simulator 2; planner and backend 3 (neither imports the other); validation
(predicted against measured) 4; front ends (rackcast/cli, rackcast/tui, tui.py) 5. Read from the source with ast:
nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {"core": 0, "topologies": 1, "simulator": 2, "planner": 3, "backend": 3, "validation": 4, "front": 5}
# The one upward edge allowed: loading a plan file resolves the hardware it names (rackcast.plan.load_plan checks the
# layout against the topology's GPU count). topologies never imports the plan, so no cycle follows.
ALLOWED = {("core", "topologies")}
FOLDERS = ("topologies", "simulator", "planner", "backend", "validation")


def layer_of_module(name: str) -> str | None:
    """The layer of a module named in the rackcast namespace (rackcast.simulator.step -> simulator)."""
    parts = name.split(".")
    if parts[0] != "rackcast":
        return None
    if len(parts) == 1:
        return "core"
    if parts[1] in FOLDERS:
        return parts[1]
    if parts[1] in ("cli", "tui"):
        return "front"
    return "core"


def source_files() -> dict[str, Path]:
    """Module name -> file, for every source module of the package and tui.py."""
    files = {"tui": ROOT / "tui.py"}
    for folder, package in [("rackcast", "rackcast")] + [(f, f"rackcast.{f}") for f in FOLDERS]:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *rel))
            files[name.removesuffix(".__init__")] = path
    return files


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def test_no_module_imports_a_higher_or_sibling_layer():
    files = source_files()
    wrong = []
    for module, path in files.items():
        own = "front" if module == "tui" else layer_of_module(module)
        for line, target in imports_of(path, module):
            other = layer_of_module(target)
            if other is None or other == own:
                continue
            if (own, other) in ALLOWED:
                continue
            if RANK[other] > RANK[own] or (RANK[other] == RANK[own]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)


def test_no_file_level_import_cycle():
    files = source_files()
    graph = {m: set() for m in files}
    for module, path in files.items():
        for _, target in imports_of(path, module):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != module and not (files[target].name == "__init__.py"
                                                    and module.startswith(target + ".")):
                graph[module].add(target)
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("needle", ["sys.path.insert", "sys.path.append", "PYTHONPATH"])
def test_no_import_path_patching(needle):
    files = source_files()
    offenders = [str(p.relative_to(ROOT)) for p in files.values() if needle in p.read_text()]
    assert not offenders, offenders


def test_layer_rule_catches_an_upward_import(tmp_path):
    """The checker itself: a simulator module importing the planner is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from rackcast.planner.search import search\n")
    targets = [t for _, t in imports_of(bad, "rackcast.simulator.bad")]
    assert any(layer_of_module(t) == "planner" for t in targets)
    assert RANK["planner"] > RANK["simulator"]
