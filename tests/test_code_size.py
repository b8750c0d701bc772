"""The house's size rules (shared/STYLE.md: "Small functions. The longest is 79 lines"; DESIGN.md: "Thin"), read
from the source.

- A function over 79 lines fails here with its name and size, so a growing function is split when it grows.
- nblib's Python lines may not grow past the number in tests/nblib_lines.txt: a change that adds lines raises
  that number in the same commit and says why in its message (a change that deletes lines may lower it).
- docs/layout.md lists the largest modules with their line counts; the list is generated, and a test checks it
  against the code. Regenerate both with `python -m tests.test_code_size --write` (from the repository root).

Classes and modules have no ceiling: a ceiling becomes a target that commits trim to fit. The total and the
listed largest modules show where the library grows instead.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nblib"
FUNCTION_LIMIT = 79
RECORDED_TOTAL = Path(__file__).with_name("nblib_lines.txt")
LAYOUT = ROOT / "docs" / "layout.md"
LARGEST = 15
BEGIN, END = "<!-- largest modules: begin -->", "<!-- largest modules: end -->"
WRITE = "python -m tests.test_code_size --write"


def module_lines(package: Path = PACKAGE) -> dict[str, int]:
    """{path under the package's parent: lines} of every Python module, lines as `wc -l` counts them."""
    return {str(p.relative_to(package.parent)): p.read_bytes().count(b"\n") for p in sorted(package.rglob("*.py"))}


def long_functions(package: Path, limit: int = FUNCTION_LIMIT) -> list[str]:
    """`where name: lines` of every function (methods too) over `limit` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > limit:
                found.append(f"function {where}:{node.lineno} {node.name}: {lines} lines (limit {limit})")
    return found


def recorded_total(path: Path = RECORDED_TOTAL) -> int:
    """The number in tests/nblib_lines.txt (its one line that is not a # comment)."""
    numbers = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return int(numbers[0])


def largest_modules_table(lines: dict[str, int], n: int = LARGEST) -> str:
    """The `n` largest modules as a Markdown table, largest first (ties by path)."""
    rows = sorted(lines.items(), key=lambda item: (-item[1], item[0]))[:n]
    return "\n".join(["| module | lines |", "| --- | ---: |", *(f"| `{path}` | {count:,} |" for path, count in rows)])


SECTION = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)


def _layout_section(text: str) -> str:
    match = SECTION.search(text)
    assert match, f"docs/layout.md has no {BEGIN} ... {END} section; add one and run {WRITE}"
    return match.group(1).rstrip("\n")


def write(lines: dict[str, int]) -> None:
    """Rewrite docs/layout.md's largest-modules list and tests/nblib_lines.txt's number from the code."""
    text = LAYOUT.read_text()
    _layout_section(text)
    LAYOUT.write_text(SECTION.sub(lambda _: f"{BEGIN}\n{largest_modules_table(lines)}\n{END}", text))
    kept = [line for line in RECORDED_TOTAL.read_text().splitlines() if line.startswith("#")]
    RECORDED_TOTAL.write_text("\n".join([*kept, str(sum(lines.values()))]) + "\n")


def test_the_size_reader_finds_a_long_method_in_a_class(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("class C:\n    def f(self):\n" + "        x = 1\n" * 79)
    assert long_functions(tmp_path / "pkg") == ["function pkg/m.py:2 f: 80 lines (limit 79)"]
    assert module_lines(tmp_path / "pkg") == {"pkg/m.py": 81}


def test_no_function_of_nblib_is_over_79_lines():
    over = long_functions(PACKAGE)
    assert not over, "split these:\n" + "\n".join(over)


def test_nblib_does_not_grow_past_the_recorded_line_count():
    total, recorded = sum(module_lines().values()), recorded_total()
    assert total <= recorded, (
        f"nblib has {total:,} Python lines, {total - recorded:,} more than the {recorded:,} recorded in "
        f"tests/nblib_lines.txt: delete what the change makes redundant, or raise the number in the same commit "
        f"and say why in its message ({WRITE})")


def test_the_largest_modules_table_is_largest_first():
    table = largest_modules_table({"p/a.py": 5, "p/b.py": 1200, "p/c.py": 5}, n=2)
    assert table.splitlines()[2:] == ["| `p/b.py` | 1,200 |", "| `p/a.py` | 5 |"]


def test_docs_layout_lists_the_largest_modules_as_they_are():
    listed, actual = _layout_section(LAYOUT.read_text()), largest_modules_table(module_lines())
    assert listed == actual, f"docs/layout.md's largest modules are out of date: run {WRITE}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {WRITE}  (rewrites docs/layout.md's largest modules and tests/nblib_lines.txt)")
    write(module_lines())
    print(largest_modules_table(module_lines()))
