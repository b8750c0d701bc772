"""The house's size limits (shared/STYLE.md: "Small functions. The longest is 79 lines"), read from the source.

A function over 79 lines, a class over 300 or a module over 650 fails here with its name and size,
so a growing function is split when it grows, not in a clean-up later.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"function": 79, "class": 300, "module": 650}


def sizes(package: Path):
    """(kind, where, lines) of every module, class and function under `package`."""
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(package.parent)
        yield "module", str(where), len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield kind, f"{where}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def over_limits(package: Path) -> list[str]:
    return [f"{kind} {where}: {lines} lines (limit {LIMITS[kind]})"
            for kind, where, lines in sizes(package) if lines > LIMITS[kind]]


def test_the_size_reader_finds_a_long_method_in_a_class(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("class C:\n    def f(self):\n" + "        x = 1\n" * 79)
    assert over_limits(tmp_path / "pkg") == ["function pkg/m.py:2 f: 80 lines (limit 79)"]


def test_no_function_class_or_module_of_nblib_is_over_the_house_limits():
    over = over_limits(ROOT / "nblib")
    assert not over, "split these:\n" + "\n".join(over)
