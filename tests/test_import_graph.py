"""nblib's import graph: no cycle between its modules, and `import nblib` stays free of torch and TF.

The graph is read from the source (AST), function-level imports included, so a cycle cannot hide
behind an import placed inside a function. An import inside `if TYPE_CHECKING:` is left out (it
never runs).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nblib"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The nblib modules `name` imports anywhere in its source (a package's name for `from p import m`)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:       # nblib.x.y.attr -> nblib.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_imports_and_package_re_exports(tmp_path):
    source = "def f():\n    from nblib.encode import run\n    import nblib.units\n"
    path = tmp_path / "x.py"
    path.write_text(source)
    known = {"nblib", "nblib.encode", "nblib.encode.run", "nblib.units"}
    assert imports_of("nblib.x", path, known) == {"nblib.encode.run", "nblib.units"}


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_nblib_has_no_import_cycle():
    found = cycles(graph())
    assert found == [], "import cycles between nblib modules (function-level imports included): " + \
        "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("heavy", ["torch", "tensorflow", "matplotlib.pyplot", "ipywidgets", "pyarrow"])
def test_import_nblib_does_not_import_heavy_frameworks(heavy):
    code = ("import sys, nblib, nblib.budget, nblib.encode, nblib.store, nblib.cache, nblib.shuffle, nblib.cli\n"
            f"print({heavy!r} in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False", f"import nblib pulled in {heavy}"


def _packages() -> list[str]:
    return sorted(module_name(p) for p in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages())
def test_every_package_declares_its_public_names_and_each_resolves(package):
    code = (f"import importlib; m = importlib.import_module({package!r}); names = m.__all__; "
            "missing = [n for n in names if not hasattr(m, n)]; print(len(names), missing)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    count, missing = result.stdout.split(" ", 1)
    assert int(count) > 0 and missing.strip() == "[]", result.stdout
