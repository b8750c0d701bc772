"""One T4 speed everywhere (issue 28): the budget, the labs, every notebook and the README give the T4's speed as
nblib.t4_speed's sourced range, and nothing else.

Why these pins exist: the suite once quoted three T4 rates at once (the reference's 94 samples/s as "the T4",
a 0.324 share of the fp16 peak, a roofline x the reference's share). A T4 figure typed anywhere, in code or in
prose, drifts from the sources. Every check here recomputes the figure from nblib.t4_speed; to change the
T4's speed, change its measurements, never a figure in a notebook or the README.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nblib import budget, reference, t4_speed
from nblib.config import preset

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]   # the README and the pages it links
T4 = re.compile(r"\bT4\b")
NUMBER = r"\d[\d,]*(?:\.\d+)?"
RATE = re.compile(rf"({NUMBER})\s*(?:samples|images)?/s\b(?:\s*\(({NUMBER})-({NUMBER})\))?")
HOURS = re.compile(rf"({NUMBER})\s*h\b(?:\s*\(({NUMBER})-({NUMBER})\s*h\))?")
PERCENT_OF_PEAK = re.compile(rf"({NUMBER})%\s*(?:\(({NUMBER})-({NUMBER})%\))?\s*of 65 TFLOP/s")
MODEL_LINE = re.compile(rf"({NUMBER})\s+GFLOP,\s+({NUMBER})/s(?:\s+\(({NUMBER})-({NUMBER})\))?(?:,\s+({NUMBER}) h)?")


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _reference_values() -> set[float]:
    """Every figure the reference quotes (nblib.reference): a README or notebook may cite them as the reference's."""
    found = set()
    for group in reference.GROUPS.values():
        for figure in group.values():
            values = figure.value if isinstance(figure.value, tuple) else (figure.value,)
            found |= {float(v) for v in values if isinstance(v, (int, float))}
    return found


def _t4_speed_values() -> set[float]:
    """The seed_t4 range's printed figures in fp16 and fp32: rates (0 decimals), hours (2) and MFU (%, 0)."""
    found = set()
    for precision, peak in (("fp16", t4_speed.T4_FP16_PEAK_FLOPS), ("fp32", 8.1e12)):
        p = t4_speed.seed_t4(precision)
        for r, h in zip((p.samples_per_s.low, p.samples_per_s.mid, p.samples_per_s.high),
                        (p.hours.high, p.hours.mid, p.hours.low)):
            found |= {float(round(r)), round(h, 2), float(round(100 * r * t4_speed.SEED_T4_FLOPS / peak))}
    return found


def _t4_passages(path: Path) -> list[tuple[str, str]]:
    """(where, text) of every passage that speaks of a T4: a prose paragraph naming one, a table row naming one,
    and each table cell under a column whose header names one. Notebook cells too, code included.
    """
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return [(f"{path.name} cell {i} ({c['cell_type']})", "".join(c["source"])) for i, c in enumerate(cells)
                if T4.search("".join(c["source"]))]
    found, header, paragraph = [], None, []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines + [""], 1):
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if n < len(lines) and re.match(r"^\|[\s|:-]+\|$", lines[n]):
                header = cells
            elif header and not re.match(r"^[\s|:-]+$", line):
                t4_columns = [c for c, h in zip(cells, header) if T4.search(h)]
                found += [(f"{path.name}:{n}", c) for c in (cells if T4.search(cells[0]) else t4_columns)]
            continue
        header = None
        if line.strip():
            paragraph.append(line)
            continue
        text = " ".join(paragraph)
        if T4.search(text):
            found.append((f"{path.name}:{n - len(paragraph)}", text))
        paragraph = []
    return found


def _figures(text: str) -> list[float]:
    """Every rate (x/s, x samples/s, with its (low-high)), time in hours and % of the fp16 peak in a passage."""
    return [_value(v) for pattern in (RATE, HOURS, PERCENT_OF_PEAK) for m in pattern.finditer(text)
            for v in m.groups() if v]


# ------------------------------------------------------------------ the code takes the range


def test_the_budget_gives_a_t4_the_sourced_range_and_its_mid():
    cfg = preset("seed_t4")
    flops = budget.flops_per_image(cfg.model)
    assert flops == t4_speed.SEED_T4_FLOPS                                  # one count of the same TRM
    for precision, speed_precision in (("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp32")):
        b = budget.predict_budget(cfg, "t4", precision=precision)
        expected = t4_speed.project(flops, speed_precision, n_samples=cfg.run.n_samples)
        assert b.speed.samples_per_s == expected.samples_per_s and b.speed.hours == expected.hours
        assert b.samples_per_s == expected.samples_per_s.mid
        assert b.seconds == pytest.approx(expected.hours.mid * 3600)
        assert b.speed.label == "projection" and "achieved FLOP/s" in b.speed_method
    b = budget.predict_budget(cfg, "t4")
    seed = t4_speed.seed_t4("fp16")
    assert b.rate_text() == seed.rate_text() and b.hours_text() == seed.hours_text()
    time_row = next(line for line in b.table().splitlines() if line.startswith("TIME"))
    assert seed.hours_text() in time_row and seed.rate_text() in time_row and "projection" in time_row
    assert seed.hours_text() in b.headline or not b.fits
    # the preset's share of peak is derived from the same range, never typed (it was 0.324: 448 samples/s)
    assert budget.device_preset("t4").efficiency * 65e12 == t4_speed.achieved_range("fp16")[0].mid
    calibrated = budget.predict_budget(cfg, "t4", efficiency=budget.calibrate("t4", 94.0, cfg))
    assert calibrated.speed is None and calibrated.samples_per_s == pytest.approx(94.0)   # a measured rate wins


def test_every_seed_t4_surface_asks_the_one_flop_count():
    """One FLOP count for seed_t4, `t4_speed.flops_per_image` of its config (issue 53 census): the typed 47.050 GFLOP
    beside the counted 47.053 is gone; the budget, seed_t4(), the reference's TRM row (and so the achieved range),
    the stand-in encoder (05) and the loaders' bar (02, 05) agree to the last digit (363.03 vs 363.01 before).
    """
    import ast
    import inspect

    from nblib.budget import memory
    from nblib.lab.input_pipeline import encoder_projection, stand_in_encoder

    flops = t4_speed.flops_per_image(preset("seed_t4").model)
    assert budget.flops_per_image is memory.flops_per_image is t4_speed.flops_per_image      # one function
    typed = [n.value for n in ast.walk(ast.parse(inspect.getsource(t4_speed)))
             if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and 4.6e10 < n.value < 4.8e10]
    assert not typed, f"a typed seed_t4 FLOP count in nblib/t4_speed.py: {typed}"
    b = budget.predict_budget(preset("seed_t4"), "t4")
    assert b.flops_per_image == t4_speed.SEED_T4_FLOPS == flops
    (trm,) = [m for m in t4_speed.MEASUREMENTS if m.name.startswith("TRM seed_t4")]
    assert trm.flops_per_sample == flops
    seed = t4_speed.seed_t4("fp16")
    assert seed == b.speed                                   # the same Projection: rate, hours and how it was made
    assert stand_in_encoder()[0] == encoder_projection(b)[0] == b.speed.samples_per_s.high


def test_every_t4_rate_a_notebook_prints_comes_from_the_range():
    from nblib.lab import input_pipeline, memory_budgeting, streaming_encoding

    seed = t4_speed.seed_t4("fp16")
    b = budget.predict_budget(preset("seed_t4"), "t4")
    rate, text = input_pipeline.stand_in_encoder()                       # notebook 05's stand-in encoder
    assert rate == seed.samples_per_s.high and seed.rate_text() in text and "projection" in text
    rate, method = input_pipeline.encoder_projection(b)                  # notebooks 02 and 05: the bar to beat
    assert rate == b.speed.samples_per_s.high and b.rate_text() in method and "projection" in method
    readout = memory_budgeting.time_readout(b)                           # notebook 01's panel
    assert b.hours_text() in readout and b.rate_text() in readout and "projection" in readout
    said = streaming_encoding.rate_check(b, 150.0)
    assert b.rate_text() in said and "nblib.t4_speed" in said


# ------------------------------------------------------------------ the prose quotes the range


@pytest.mark.parametrize("path", [*DOCS, *NOTEBOOKS], ids=lambda p: p.name)
def test_every_t4_speed_figure_in_the_readme_and_the_notebooks_is_the_range_or_the_reference(path):
    """A rate, a time or an MFU beside "T4" is the reference's own figure (quoted) or, in the README only, one of
    nblib.t4_speed's printed figures. A notebook prints the range from code: its prose and code carry none.
    """
    readme = path.suffix == ".md"
    allowed = _reference_values() | (_t4_speed_values() if readme else set())
    wrong = [(where, figure) for where, text in _t4_passages(path)   # model lines: the test below recomputes them
             for figure in _figures(MODEL_LINE.sub(" ", text) if readme else text) if figure not in allowed]
    assert not wrong, (f"T4 speed figures that are neither nblib.t4_speed's range "
                       f"({t4_speed.seed_t4().summary()}) nor the reference's: {wrong}; print the range from "
                       f"code (t4_speed.seed_t4().summary(), Budget.rate_text()) instead of typing a figure")


def test_the_readme_quotes_the_seed_t4_range_and_model_lines_match_their_flops():
    text = "\n".join(path.read_text() for path in DOCS)                    # the figures live in docs/ now
    seed = t4_speed.seed_t4("fp16")
    assert f"**{seed.hours_text()}**" in text and seed.rate_text() in text           # the table's T4 column
    assert t4_speed.seed_t4("fp32").rate_text() in text
    lines = list(MODEL_LINE.finditer(text))
    assert len(lines) >= 5, "the README's model projections (benchmarks/model_projections.py) went missing"
    for m in lines:                                                       # "ViT-B/16 35.1 GFLOP, 403/s (334-486)"
        gflop, mid, low, high, hours = (None if v is None else _value(v) for v in m.groups())
        p = t4_speed.project(gflop * 1e9, "fp16", n_samples=t4_speed.SEED_T4_IMAGES)
        tolerance = 0.5 * 10 ** -len(m.group(1).split(".")[-1]) / gflop + 0.005   # the GFLOP's rounding
        for said, r in ((mid, p.samples_per_s.mid), (low, p.samples_per_s.low), (high, p.samples_per_s.high)):
            assert said is None or said == pytest.approx(r, rel=tolerance), m.group(0)
        assert hours is None or hours == pytest.approx(p.hours.mid, rel=tolerance), m.group(0)


def test_a_typed_t4_rate_is_caught(tmp_path):
    """The scan's own check: the old figures (448 samples/s, 1.2 h, 32% of the peak) fail it."""
    allowed = _reference_values() | _t4_speed_values()
    for old in ("| 448 samples/s (simulated: roofline 739 x 0.61) |", "**full run on a T4**: **1.2 h**",
                "32% of 65 TFLOP/s", "a T4 encodes 345 samples/s (270-430)"):
        assert any(f not in allowed for f in _figures(old)), old
    readme = tmp_path / "README.md"
    readme.write_text("| figure | simulated T4 | CPU |\n|---|---|---|\n"
                      "| samples/s fp16 | 448 samples/s | 204 samples/s |\n")
    assert [f for _, p in _t4_passages(readme) for f in _figures(p)] == [448.0]
