"""One loop: a single place in revffn/ steps an optimizer (`train_step`; `InBackward`'s per-parameter hook is
that same step, moved into backward), and a single module builds one (`training/optim.py`). A heal, a bench
measurement or a study run that wants to train goes through `build_run` / `train_step`."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "revffn"
OPTIMIZERS = {"AdamW", "Adam", "SGD", "Adafactor", "AdamW8bit", "AdamW4bit", "_AdamW", "CPUOffloadOptimizer"}


def _functions(tree: ast.AST):
    """(qualified name, node) of every function, nested ones under their parents' names."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def _name(node: ast.AST) -> str:
    """`optimizer` -> 'optimizer', `self.run.optimizer` -> 'optimizer', `opts[i]` -> 'opts'."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def step_sites(package: Path) -> set[str]:
    """'file:function' for every call `X.step()` on an optimizer (a receiver named like one: `optimizer`,
    `opt`, `self.optimizers[i]`; not the watchdog's `watch.step`), listed under the innermost function."""
    sites = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for name, fn in _functions(tree):
            inner = {id(n) for _, f in _functions(fn) for n in ast.walk(f)}
            for node in ast.walk(fn):
                if id(node) in inner:
                    continue
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step" \
                        and "opt" in _name(node.func.value):
                    sites.add(f"{path.relative_to(package.parent)}:{name}")
    return sites


def optimizer_builders(package: Path) -> set[str]:
    """Files that name an optimizer class (torch's or torchao's)."""
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in OPTIMIZERS or \
                    isinstance(node, ast.Name) and node.id in OPTIMIZERS:
                found.add(str(path.relative_to(package.parent)))
    return found


def test_one_function_steps_an_optimizer():
    assert step_sites(PACKAGE) == {"revffn/training/step.py:train_step",
                                   "revffn/training/optim.py:InBackward._hook.step"}


def test_one_module_builds_optimizers():
    assert optimizer_builders(PACKAGE) <= {"revffn/training/optim.py", "revffn/training/step.py"}


def test_the_count_sees_a_second_loop(tmp_path):
    fake = tmp_path / "revffn" / "conversion"
    fake.mkdir(parents=True)
    (fake / "heal.py").write_text("import torch\n\ndef heal(model):\n    opt = torch.optim.AdamW(model.parameters())\n"
                                  "    for _ in range(3):\n        opt.step()\n")
    assert step_sites(tmp_path / "revffn") == {"revffn/conversion/heal.py:heal"}
    assert optimizer_builders(tmp_path / "revffn") == {"revffn/conversion/heal.py"}
