"""The package's layer order, as the folders show it: imports only go down, never up, no cycles.

    errors, progress -> schema -> reversible -> archs -> conversion -> models -> memory -> data -> methods
    -> training -> reports -> cli

Every `import revffn.X` / `from revffn.X import ...` counts, also the ones inside functions (a lazy
import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "revffn"
LAYERS = [("errors", "progress"), ("schema",), ("reversible",), ("archs",), ("conversion",), ("models",), ("memory",),
          ("data",), ("methods",), ("training",), ("reports",), ("cli",)]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
ENTRY_POINTS = {"__init__", "__main__"}  # the package's public surface and `python -m revffn`: above every layer


def unit(module: str) -> str:
    """'revffn.conversion.convert' -> 'models'; 'revffn.cli' -> 'cli'; 'revffn' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, root: Path) -> set[str]:
    """The revffn modules `path` imports (absolute and relative imports, at any depth in the file)."""
    rel = path.relative_to(root).with_suffix("")
    here = list(rel.parts if rel.name != "__init__" else rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "revffn"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here[: len(here) - node.level + 1] if rel.name == "__init__" else here[: len(here) - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "revffn":
                found.add(mod)
                for a in node.names:  # `from revffn.reports import bench`: the submodule is imported too
                    sub = root / f"{mod}.{a.name}".replace(".", "/")
                    if sub.with_suffix(".py").exists() or sub.is_dir():
                        found.add(f"{mod}.{a.name}")
    return found


def edges(package: Path) -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, file) for every import between different units."""
    out = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        src = unit(".".join(rel.parts))
        for mod in imports(path, package.parent):
            dst = unit(mod)
            if dst != src:
                out.add((src, dst, str(rel)))
    return out


def upward_imports(package: Path) -> list[str]:
    return sorted(f"{file}: {src} -> {dst}" for src, dst, file in edges(package)
                  if src not in ENTRY_POINTS and dst in LEVEL and LEVEL[dst] >= LEVEL.get(src, -1))


def cycles(package: Path) -> list[str]:
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges(package):
        graph.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ()))

    return sorted(u for u in graph if reaches(u, u, set()))


def module_graph(package: Path) -> dict[str, set[str]]:
    """revffn module -> the revffn modules it imports (a package's `__init__` is the package's name)."""
    paths = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        paths[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph = {}
    for name, path in paths.items():
        found = set()
        for mod in imports(path, package.parent):
            while mod and mod not in paths:  # `from revffn.x.y import name`: the module is revffn.x.y
                mod = mod.rpartition(".")[0]
            if mod and mod != name:
                found.add(mod)
        graph[name] = found
    return graph


def module_cycles(package: Path) -> list[list[str]]:
    """The import circles between modules: strongly connected components of more than one module (Tarjan)."""
    graph, index, low, stack, found = module_graph(package), {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_unit_has_a_layer():
    units = {unit(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)) for p in PACKAGE.rglob("*.py")}
    assert units - ENTRY_POINTS - {"recipes", "assets"} <= set(LEVEL), units - set(LEVEL)


def test_imports_only_go_down_the_layers():
    upward = upward_imports(PACKAGE)
    assert not upward, "imports that go up (or sideways) the layer order:\n" + "\n".join(upward)


def test_no_import_cycle_between_packages():
    assert not cycles(PACKAGE), f"packages on an import cycle: {cycles(PACKAGE)}"


def test_no_import_cycle_between_modules():
    """Within a package too: no module reaches itself through imports (lazy ones included)."""
    assert not module_cycles(PACKAGE), f"modules on an import cycle: {module_cycles(PACKAGE)}"


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
    """The checks themselves can fail: a lazy import from models up to training is caught."""
    fake = tmp_path / "revffn"
    (fake / "models").mkdir(parents=True)
    (fake / "training").mkdir()
    (fake / "models" / "bad.py").write_text("def f():\n    from revffn.training.loop import train\n")
    (fake / "training" / "loop.py").write_text("from revffn.models import bad\n")
    assert upward_imports(fake) == ["revffn/models/bad: models -> training"]
    assert cycles(fake) == ["models", "training"]
    (fake / "models" / "a.py").write_text("from revffn.models.b import g\n")
    (fake / "models" / "b.py").write_text("def g():\n    from revffn.models import a\n")
    assert module_cycles(fake) == [["revffn.models.a", "revffn.models.b"],
                                   ["revffn.models.bad", "revffn.training.loop"]]
