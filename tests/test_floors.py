"""The package is a house of floors (the course's ladder): each unit imports only units on floors below it, and
the modules inside one unit form no circle. Read from the source (every ``import`` statement, at any depth, and
every string that names a k3course module, as ``importlib.import_module`` takes), not from what one run loads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "k3course"

# floor -> the units on it (a unit is a top-level module or a sub-package of k3course)
FLOORS = {
    0: {"guards"},
    1: {"config", "data", "device", "debug", "layout", "params", "parts", "reference"},
    2: {"ops", "pretrained"},
    3: {"kernels", "pretrained_save"},
    4: {"layers", "moe"},
    5: {"model"},
    6: {"accounting", "checkpoint", "pretrained_generation"},
    7: {"baselines", "distributed"},
    8: {"train"},
    9: {"lessons", "runs"},
    10: {"bench"},
    11: {"grading", "doctor"},
    12: {"cli"},
}
FLOOR_OF = {unit: floor for floor, units in FLOORS.items() for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def unit_of(module: str) -> str | None:
    """``k3course.ops.chunk`` -> ``ops``; the package itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def resolve(name: str) -> str | None:
    """The k3course module an imported name lives in (``k3course.ops.kda_chunk`` -> ``k3course.ops``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str) -> set[str]:
    """The k3course modules ``source`` imports, wherever the statement stands, plus modules named in strings."""
    tree = ast.parse(source)
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: climb node.level - 1 packages from this one
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            found.add(node.value)
    return {resolved for name in found if name.startswith("k3course") and (resolved := resolve(name))} - {module}


GRAPH = {module: imports_of(module, path.read_text()) for module, path in MODULES.items()}


def test_every_unit_has_a_floor():
    units = {unit_of(module) for module in MODULES} - {None}
    assert units <= set(FLOOR_OF), f"units without a floor: {sorted(units - set(FLOOR_OF))}"


def climbing_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Arrows from one unit to another unit on the same floor or above."""
    arrows = []
    for source, targets in graph.items():
        for target in targets:
            if target == "k3course" or unit_of(source) is None or unit_of(source) == unit_of(target):
                continue
            if FLOOR_OF[unit_of(target)] >= FLOOR_OF[unit_of(source)]:
                arrows.append(f"{source} (floor {FLOOR_OF[unit_of(source)]}) -> {target} "
                              f"(floor {FLOOR_OF[unit_of(target)]})")
    return sorted(arrows)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and modules that import themselves."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_arrow_climbs_a_floor():
    assert climbing_arrows(GRAPH) == []


def test_no_circle():
    assert circles(GRAPH) == []


def test_the_checks_catch_a_climbing_arrow_and_a_circle():
    """The two checks fail on a graph that breaks them (a config that imports the model, a two-module loop), and the
    reader sees an import inside a function and a module named in a string."""
    broken = {"k3course.config": {"k3course.model"}, "k3course.model": {"k3course.config"}}
    assert climbing_arrows(broken) == ["k3course.config (floor 1) -> k3course.model (floor 5)"]
    assert circles(broken) == [["k3course.config", "k3course.model"]]
    assert imports_of("k3course.config", "def f():\n    from k3course.model import K3Model\n") == {"k3course.model"}
    assert imports_of("k3course.lessons.parts", "PARTS = {'a': ('k3course.ops.chunk', 'f')}") == {"k3course.ops.chunk"}


def _definitions(pattern: str) -> list[str]:
    return sorted(f"{module}: {match}" for module, path in MODULES.items()
                  for match in re.findall(pattern, path.read_text(), flags=re.M))


def test_one_training_step():
    assert len(_definitions(r"^\s*def train_step\(")) == 1, _definitions(r"^\s*def train_step\(")


def test_one_bias_update():
    assert len(_definitions(r"^\s*def update_bias\(")) == 1, _definitions(r"^\s*def update_bias\(")


def copies_attributes(source: str) -> bool:
    """Whether ``source`` builds an object by copying another's attributes: ``for ... in vars(x).items()`` (or
    ``x.__dict__``) with a ``setattr`` in the loop."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Attribute):
            owner = node.iter.func.value
            reads_vars = isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "vars"
            reads_dict = isinstance(owner, ast.Attribute) and owner.attr == "__dict__"
            sets = any(isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "setattr"
                       for inner in ast.walk(node))
            if (reads_vars or reads_dict) and sets:
                return True
    return False


def test_no_module_is_built_by_copying_another_modules_attributes():
    assert copies_attributes("for name, value in vars(layer).items():\n    setattr(self, name, value)\n")
    assert not copies_attributes("options = vars(args)\n")
    assert [module for module, path in MODULES.items() if copies_attributes(path.read_text())] == []
