"""Item 4 of issue 19: the cache-size prediction uses bytes per image measured on the user's texts, says
which it used, and the planner tries every codec of the registry.
"""
from __future__ import annotations

import subprocess
import sys

from nblib import budget, config
from nblib.cache import sample_texts_path
from nblib.codec_sizes import CodecSizes, codec_sizes

SEED = config.preset("seed_t4")


def test_sizes_are_measured_on_the_given_texts_and_borrowed_only_without_them():
    measured = codec_sizes(sample_texts_path(), 64, n=40)
    assert measured.measured and "measured on 40 texts of sample_texts.jsonl" in measured.source
    assert set(measured.bytes_per_image) == set(config.CODECS)
    assert 0 <= measured.bytes_per_image["raw"] - 64 * 64 * 3 <= 16      # the pixels, plus a per-image checksum
    assert measured.bytes_per_image["zlib"] < measured.bytes_per_image["raw"] / 5
    borrowed = codec_sizes(None, 224)
    assert not borrowed.measured and "reference" in borrowed.source and "not measured" in borrowed.source


def test_the_plan_for_the_reference_job_fits_a_free_drive_with_measured_sizes():
    # this suite's texts compress ~35x: a zlib cache plus checksums fits 15 GB; the borrowed 0.14 ratio does not
    sizes = codec_sizes(sample_texts_path(), 224, n=60)
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=sizes)
    assert plan.fits and plan.config.run.codec != "raw" and "measured on 60 texts of sample_texts.jsonl" in str(plan)
    borrowed = budget.plan_budget(SEED, "t4", drive_quota_gb=15)
    assert not borrowed.fits and "reference analysis' ratios" in str(borrowed)


def test_the_planner_tries_every_codec_of_the_registry():
    # sizes for every codec of the cache's registry; only the last one in the registry fits the 15 GB Drive
    raw = 224 * 224 * 3
    *others, last = config.CODECS
    sizes = CodecSizes({**{c: raw * (1.0 if c == "raw" else 0.2) for c in others}, last: raw * 0.02}, 224,
                       "synthetic", True)
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=sizes)
    assert plan.fits and plan.changes["codec"] == last


def test_budget_plan_cli_measures_the_given_texts():
    out = subprocess.run([sys.executable, "-m", "nblib", "budget", "--plan", "--texts", str(sample_texts_path())],
                         capture_output=True, text=True, check=True).stdout
    assert "measured on 300 texts of sample_texts.jsonl" in out and "FITS with codec=" in out


def test_the_readmes_budget_line_gives_notebook_01s_answer():
    """Issue 53: the README's `budget --preset seed_t4 --device t4 --plan` said NOTHING FITS on a borrowed ratio
    while notebook 01 measured the shipped texts and said FITS. The line, as typed, now gives 01's answer, says
    in its first line what sized the cache, and advises one Drive quota at most.
    """
    import re
    import shlex
    from pathlib import Path

    from cli_runner import run_nblib

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    line = next(ln for ln in readme.splitlines() if "nblib budget --preset seed_t4" in ln)
    argv = shlex.split(line.split("#")[0])
    run = run_nblib(*argv[argv.index("budget"):])
    assert run.returncode == 0, run.stderr
    sizes = codec_sizes(sample_texts_path(), SEED.model.image_size)       # notebook 01 [9]: TEXTS None
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=sizes)           # 01 [13]
    verdict = budget.predict_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=sizes).verdict   # 01 [24]
    assert str(plan) in run.stdout and verdict in run.stdout, run.stdout
    first = run.stdout.splitlines()[0]
    assert first.startswith(str(sizes)) and "sample texts" in first, first
    assert len(set(re.findall(r"drive_quota_gb=(\d+)", run.stdout))) <= 1, run.stdout
