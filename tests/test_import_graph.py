"""nblib's import graph: no cycle between its modules or its packages, every import goes down the
layers (`LAYERS` below), and `import nblib` stays free of torch and TF.

The graph is read from the source (AST), function-level imports included, so a cycle cannot hide
behind an import placed inside a function. An import inside `if TYPE_CHECKING:` is left out (it
never runs). Between packages, a string that names an nblib module (whole, or as "module:attr") counts
as an import of it: a module run by its name (`python -m`, `importlib.import_module`, a child process)
is an arrow the import statements do not draw.
"""
from __future__ import annotations

import ast
import re
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


MODULE_NAME = re.compile(r"nblib(\.\w+)*(:[\w.]+)?")      # "nblib.x.y" or "nblib.x.y:function"


def import_lines(name: str, path: Path, known: set[str], strings: bool = False) -> list[tuple[str, int]]:
    """(nblib module, line) for every import in `name`'s source, inside functions too (a package's
    name for `from p import m`); not those under `if TYPE_CHECKING:`, nor `name` itself. strings: a string
    constant that is an nblib module's name (or "module:attr") counts too.
    """
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                MODULE_NAME.fullmatch(node.value) and node.value.partition(":")[0] in known:
            targets = [node.value.partition(":")[0]]
        elif isinstance(node, ast.Import):
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
                found.append((target, node.lineno))
    return sorted(set(found), key=lambda t: (t[1], t[0]))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The nblib modules `name` imports anywhere in its source (a package's name for `from p import m`)."""
    return {target for target, _ in import_lines(name, path, known)}


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


def test_a_module_named_by_a_string_counts_as_an_import_between_packages(tmp_path):
    """The budget once ran `CHILD = "nblib.simulate.job_trace"` in a child process: an arrow up that no import drew."""
    (tmp_path / "nblib" / "budget").mkdir(parents=True)
    path = tmp_path / "nblib" / "budget" / "x.py"
    path.write_text('"""Runs nblib.simulate.job_trace, in prose."""\nCHILD = "nblib.simulate.job_trace"\n'
                    'RUN = ["-m", "nblib.train.probe:main"]\nKIND = "nblib.train.run"\n')
    known = {"nblib.budget.x", "nblib.simulate.job_trace", "nblib.train.probe"}
    assert import_lines("nblib.budget.x", path, known) == []
    assert import_lines("nblib.budget.x", path, known, strings=True) == [("nblib.simulate.job_trace", 2),
                                                                          ("nblib.train.probe", 3)]


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


# The layers of nblib, lowest first (README "Layout" gives the same order). A package or top-level
# module imports only from its own layer or a lower one, inside functions too; within a layer the
# package graph has no cycle either (test below). A module two layers need goes in the lower one.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple((name, frozenset(members.split())) for name, members in (
    ("core", "errors units atomic manifest config lock disk malloc pool proc compare verdict reference sdpa "
             "render t4_speed"),
    ("machine", "env"),                                   # where am I: Colab / local, Drive, hardware
    ("models and predictions", "trm models budget measure"),     # budget: pure calculators every job preflights with
    ("data and storage", "store cache shuffle codec_sizes"),
    ("jobs", "encode train export pipeline tfdata"),
    ("simulation", "simulate"),                           # runs the jobs' own code on a fake GPU
    ("notebooks", "lab suite"),
    ("views", "plots widgets"),
    ("command line", "cli __main__"),
))


def package_of(module: str) -> str:
    """nblib.budget.disk -> budget, nblib.env -> env, nblib -> nblib (the root is no layer's)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_index() -> dict[str, int]:
    return {member: i for i, (_, members) in enumerate(LAYERS) for member in members}


def package_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, from package, to package) for every import that crosses a package boundary."""
    mods = modules()
    known = set(mods)
    found = []
    for name, path in mods.items():
        for target, line in import_lines(name, path, known, strings=True):
            here, there = package_of(name), package_of(target)
            if here != there and "nblib" not in (here, there):
                found.append((str(path.relative_to(ROOT)), line, here, there))
    return found


def package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {package_of(m): set() for m in modules() if m != "nblib"}
    for _, _, here, there in package_imports():
        edges[here].add(there)
    return edges


def upward_imports(imports: list[tuple[str, int, str, str]], layers: dict[str, int]) -> list[str]:
    """`file:line: from -> to (layer -> higher layer)` for each import from a lower layer to a higher one."""
    names = [name for name, _ in LAYERS]
    return [f"{file}:{line}: {here} -> {there} ({names[layers[here]]} imports {names[layers[there]]})"
            for file, line, here, there in imports if layers[here] < layers[there]]


def test_every_package_and_top_level_module_has_one_layer():
    members = [m for _, ms in LAYERS for m in ms]
    assert len(members) == len(set(members)), "a package is in two layers"
    unplaced = sorted(set(package_graph()) - set(members))
    assert unplaced == [], f"put {unplaced} in a layer of tests/test_import_graph.py LAYERS (and README Layout)"
    assert sorted(set(members) - set(package_graph())) == [], "LAYERS names a package that does not exist"


def test_the_layer_check_names_the_file_line_and_packages_of_an_upward_import():
    layers = {"budget": 0, "simulate": 1}
    imports = [("nblib/budget/vram_replay.py", 19, "budget", "simulate"),
               ("nblib/simulate/x.py", 3, "simulate", "budget")]
    found = upward_imports(imports, layers)
    assert len(found) == 1 and found[0].startswith("nblib/budget/vram_replay.py:19: budget -> simulate")


def test_no_package_imports_a_higher_layer():
    found = upward_imports(package_imports(), layer_index())
    assert found == [], "imports from a lower layer to a higher one (tests/test_import_graph.py LAYERS):\n" + \
        "\n".join(found)


def test_nblib_has_no_package_level_import_cycle():
    found = cycles(package_graph())
    assert found == [], "package-level import cycles (function-level imports included): " + \
        "; ".join(" <-> ".join(c) for c in found)


# The library's floors a notebook's lab stands on: none of them imports nblib.lab (a concept the CLI or a job
# needs lives in its own package, and the lab imports it from there).
NO_LAB = ("cli", "budget", "cache", "train", "encode", "store")


def lab_imports(mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """`file:line: module -> nblib.lab...` for every import of nblib.lab from a package in NO_LAB."""
    known = set(mods)
    return [f"{path.relative_to(root)}:{line}: {name} -> {target}"
            for name, path in mods.items() if package_of(name) in NO_LAB
            for target, line in import_lines(name, path, known, strings=True)
            if target == "nblib.lab" or target.startswith("nblib.lab.")]


def test_the_lab_check_sees_an_import_of_the_lab_inside_a_function(tmp_path):
    (tmp_path / "nblib" / "cli").mkdir(parents=True)
    path = tmp_path / "nblib" / "cli" / "x.py"
    path.write_text("def f():\n    from nblib.lab.memory_budgeting import reference_table\n")
    mods = {"nblib.cli.x": path, "nblib.lab": tmp_path, "nblib.lab.memory_budgeting": tmp_path}
    found = lab_imports(mods, root=tmp_path)
    assert found == ["nblib/cli/x.py:2: nblib.cli.x -> nblib.lab.memory_budgeting"]


def test_no_cli_or_library_package_imports_the_lab():
    found = lab_imports(modules())
    assert found == [], "move what these need out of nblib.lab into its own package:\n" + "\n".join(found)
