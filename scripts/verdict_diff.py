"""Diff the computed verdicts of two executions of the same notebooks (issue 30's "make run twice" check).

    python scripts/verdict_diff.py RUN1 RUN2 [--max-moves 2]

RUN1 and RUN2 are two executed copies of a notebook, or two folders of them (`make run` writes
outputs/notebooks/; notebooks are paired by file name). Every verdict a cell printed is read from
its outputs and classed as firm (with its direction: faster, slower, agrees, holds, ...) or "not
distinguishable" (not distinguishable here, too small to see here, too few pairs, cannot show it):

- paired speed verdicts (`nblib.verdict.PairedVerdict.short`: "x1.32 (95% interval 1.21-1.40, 7 pairs): faster"),
- memory verdicts ("+12 MB (5 pairs, RSS noise 3 MB): more"),
- notebook 05's findings ("larger batches helped: AGREES"), its recommendation and its cache-less
  verdict ("rendering keeps up / would starve"), 01's prediction check ("the prediction holds /
  misses"), and `verdict:` lines.

A verdict printed twice (the same interval restated by a summary line or a finding) counts once:
the later copy is skipped, and a finding whose measurement is such a restatement is checked for a
reversal but not counted as a move. The summary: verdicts compared, reversals (firm both times,
opposite directions; a recommendation that picks another config, or a sentence verdict that says
another thing, counts as one too), moves (firm one time, not distinguishable the other), and
verdicts found in one run only. Exit status 1 when there is a reversal or more moves than --max-moves, else 0.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PAIRED = re.compile(r"x(?P<head>[\d.,]+ \(95% interval [\d.]+-[\d.]+, \d+ (?:pairs|runs)\)): (?P<call>.+)$")
MEMORY = re.compile(r"(?P<head>[+-][\d.,]+ ?[kMGT]?i?B \((?:95% interval [^,]*, )?\d+ pairs, RSS noise [^)]*\)): "
                    r"(?P<call>more|less|too small to see here)")
FINDING = re.compile(r"^(?P<label>\S.*): (?P<call>AGREES|DOES NOT|NOT DISTINGUISHABLE ON THIS MACHINE)$")
PICK = re.compile(r"^(?P<label>[a-z_]+=.*?): [\d,.]+ ?[kM]? ?samples/s (?P<call>\(the base: no config|= x[\d.]+ "
                  r"the base over \d+ pairs \((?:faster|slower|not distinguishable|too few))")
PREDICTION = re.compile(r"^(?P<call>the prediction holds|the prediction misses|too small to see here: every figure)")
CACHELESS = re.compile(r"^at \d+ px, \d+ loader workers render .*: (?P<call>rendering keeps up|rendering would starve"
                       r"|not distinguishable on this machine)")
SENTENCE = re.compile(r"^\s*verdict: (?P<call>.+)$")
UNDECIDED = ("not distinguishable", "too small to see", "too few", "cannot show", "no scaling shown",
             "the base: no config")


@dataclass(frozen=True)
class Verdict:
    """One verdict a notebook printed: where (notebook, cell, label), its call, firm or not, restated or not."""

    notebook: str
    cell: int
    label: str
    call: str          # the direction of a firm verdict ("faster", "agrees", ...) or "not distinguishable"
    firm: bool
    restated: bool = False

    @property
    def key(self) -> tuple:
        return (self.cell, self.label)       # the notebook is paired by the caller


def extract(path: str | Path) -> list[Verdict]:
    """Every verdict printed by an executed notebook's code cells, in order (restatements marked or skipped)."""
    nb = json.loads(Path(path).read_text())
    name, seen, found, counts = Path(path).name, set(), [], {}
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        lines = _output_text(cell).splitlines()
        for n, line in enumerate(lines):
            got = _verdict_of_line(line, _parent(lines[:n], line), lines[n + 1:n + 3], seen)
            if got is None:
                continue
            label, call, firm, restated = got
            counts[(index, label)] = counts.get((index, label), 0) + 1
            if counts[(index, label)] > 1:
                label = f"{label} #{counts[(index, label)]}"
            found.append(Verdict(name, index, label, call, firm, restated))
    return found


def compare_runs(first: list[Verdict], second: list[Verdict]) -> list[tuple[Verdict | None, Verdict | None, str]]:
    """Pair the verdicts of two runs by key; each pair with its status: same, move, REVERSAL, only in run 1/2."""
    by_key = {v.key: v for v in second}
    out = []
    for v in first:
        w = by_key.pop(v.key, None)
        out.append((v, w, "only in run 1" if w is None else status(v, w)))
    out += [(None, w, "only in run 2") for w in by_key.values()]
    return out


def status(a: Verdict, b: Verdict) -> str:
    if a.firm and b.firm:
        return "same" if a.call == b.call else "REVERSAL"
    if a.firm != b.firm:
        return "move (restated)" if a.restated or b.restated else "move"
    return "same"


def summary(pairs) -> dict:
    states = [s for _, _, s in pairs]
    return {"verdicts": len(pairs), "reversals": states.count("REVERSAL"), "moves": states.count("move"),
            "restated moves": states.count("move (restated)"),
            "only in one run": sum(s.startswith("only") for s in states)}


def notebook_pairs(run1: str | Path, run2: str | Path) -> list[tuple[Path, Path]]:
    """(run 1's copy, run 2's copy) of each notebook: two files, or the notebooks two folders share by name."""
    run1, run2 = Path(run1), Path(run2)
    if run1.is_file() and run2.is_file():
        return [(run1, run2)]
    if run1.is_dir() and run2.is_dir():
        names = sorted({p.name for p in run1.glob("*.ipynb")} & {p.name for p in run2.glob("*.ipynb")})
        return [(run1 / n, run2 / n) for n in names]
    raise SystemExit(f"error: give two executed notebooks or two folders of them; got {run1} and {run2}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run1")
    parser.add_argument("run2")
    parser.add_argument("--max-moves", type=int, default=2, help="moves allowed in total (default 2)")
    args = parser.parse_args(argv)
    pairs = []
    for a, b in notebook_pairs(args.run1, args.run2):
        pairs += compare_runs(extract(a), extract(b))
    for v, w, state in pairs:
        where = v or w
        print(f"{state:<16} {where.notebook} cell {where.cell}: {where.label}\n"
              f"{'':<16}   run 1: {_call(v)}\n{'':<16}   run 2: {_call(w)}")
    total = summary(pairs)
    print("summary: " + ", ".join(f"{k} {n}" for k, n in total.items()) + f" (moves allowed: {args.max_moves})")
    return int(total["reversals"] > 0 or total["moves"] > args.max_moves)


# ------------------------------------------------------------------------------ helpers


def _parent(above: list[str], line: str) -> str:
    """The head (text before its first colon) of the nearest line above `line` that is indented less."""
    indent = len(line) - len(line.lstrip())
    for prev in reversed(above):
        if prev.strip() and len(prev) - len(prev.lstrip()) < indent:
            return prev.split(":")[0].strip()
    return ""


def _output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            parts.append(_joined(out.get("text", "")))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(_joined(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _joined(text) -> str:
    return "".join(text) if isinstance(text, list) else str(text)


def _verdict_of_line(line: str, parent: str, following: list[str], seen: set):
    """(label, call, firm, restated) of a line that carries a verdict, else None. `seen`: intervals met so far."""
    stripped = line.strip()
    if m := PICK.match(stripped):
        firm = not _undecided(m.group("call"))
        return "recommendation", m.group("label") if firm else "not distinguishable", firm, False
    if "mattered most" in line or stripped.startswith(("this machine", "reference")):
        return None                    # restatements of verdicts printed on their own lines
    if m := FINDING.match(stripped):
        restated = any(p.group("head") in seen for x in following if (p := PAIRED.search(x)))
        call = m.group("call").lower()
        return m.group("label"), *_phrase(call), restated
    if m := PREDICTION.match(stripped):
        return "prediction vs measurement", *_phrase(m.group("call")), False
    if m := CACHELESS.match(stripped):
        return "rendering against the encoder", *_phrase(m.group("call")), False
    for pattern in (PAIRED, MEMORY):
        if m := pattern.search(line):
            if m.group("head") in seen:
                return None
            seen.add(m.group("head"))
            return _label(line[:m.start()], parent), *_first_word(m.group("call")), False
    if m := SENTENCE.match(line):
        return "verdict", *_phrase(" ".join(m.group("call").split(":")[0].split()[:5])), False
    return None


def _phrase(call: str) -> tuple[str, bool]:
    """A sentence's call: the phrase itself, numbers masked (firm), or "not distinguishable"."""
    if _undecided(call):
        return "not distinguishable", False
    return re.sub(r"\d[\d.,%]*", "#", call).strip(" ,;"), True


def _first_word(call: str) -> tuple[str, bool]:
    """A paired or memory verdict's call: its first word ("faster", "more", ...), or "not distinguishable"."""
    if _undecided(call):
        return "not distinguishable", False
    return re.split(r"[ ,(;]", call.strip(), maxsplit=1)[0], True


def _undecided(text: str) -> bool:
    return any(word in text for word in UNDECIDED)


def _label(before: str, parent: str) -> str:
    """A verdict's name from the text before it: 'A vs B' where the line says so, else the text, under its parent.

    Numbers that a run computes are masked in the parent line, so the same verdict has the same name in two runs.
    """
    text = before.strip().rstrip(":,").strip()
    vs = re.search(r"([^:]*\bvs\b[^:]*)$", text)
    if vs:
        return re.sub(r"^(verdict: )?rendering speed-up ", "", vs.group(1).strip())
    if text.startswith("verdict:"):                 # a sentence's own measurements are no part of its name
        text = re.sub(r"\d[\d.,%]*", "#", text)
    parent = re.sub(r"\d[\d.,%]*", "#", parent)[:60]
    if before.startswith(" ") and parent and not re.fullmatch(r"\S+=\S+", text):
        return f"{parent}: {text}" if text else parent
    return text or parent or "verdict"


def _call(v: Verdict | None) -> str:
    if v is None:
        return "-"
    return ("firm: " if v.firm else "") + v.call + (" (restates a verdict above)" if v.restated else "")


if __name__ == "__main__":
    sys.exit(main())
