"""Issue 37, "three codec answers for one job": the codec is the one rule's (`nblib.budget.choose_codec`: the
fastest-decoding codec whose cache fits, what `cache --codec auto` builds with), on every surface that names one:
the plan, the verdict's advice, the cache and encode refusals, `budget --plan`, `cache --codec auto`. Sizes and
decode rates travel together (`CodecSizes`), and every line says whether its ratio was measured or borrowed.
"""
from __future__ import annotations

import collections
import json
import re
import sys

import pytest
from cli_runner import run_nblib

import nblib
from nblib import budget, config
from nblib.budget.advice import cache_knobs, knob_words
from nblib.budget.disk import CODEC_DECODE_ESTIMATE, CODEC_RATIO_ESTIMATE, cache_bytes
from nblib.cache import sample_texts_path
from nblib.codec_sizes import CodecSizes, measure_codec_sizes, reference_codec_sizes

SEED = config.preset("seed_t4")          # 1,907,747 images at 224 px, every output, raw cache
GB = 1e9
SIZES = {"raw": 150_536, "png": 5_246, "zlib": 4_232, "zstd": 2_349}   # 01's 300 sample texts at 224 px
# zlib decodes fastest of the compressed codecs here, zstd is the smallest, png the largest: "the least
# compressed that fits" (png), "the smallest first" (zstd) and the one rule (zlib) all differ.
RATES = {"raw": 87_000, "zlib": 30_000, "zstd": 12_000, "png": 1_500}
MEASURED = CodecSizes(SIZES, 224, "measured on 300 texts of mine.txt", True, RATES, 300)
CODEC = re.compile(r"codec='(\w+)'")


def named_codecs(text: str) -> set[str]:
    return set(CODEC.findall(text))


def fitting(n_images: int, free: float, sizes: dict) -> list[str]:
    return [c for c in sizes if n_images * sizes[c] <= 0.9 * free]


def test_plan_verdict_refusals_and_the_cli_name_the_one_rules_codec(monkeypatch, tmp_path):
    n = SEED.run.n_samples
    rule = budget.choose_codec(n, 70 * GB, MEASURED)          # a 70 GB disk: every compressed cache fits
    assert rule == "zlib" and {"png", "zstd"} <= set(fitting(n, 70 * GB, SIZES))
    need = cache_bytes(n, 224, "raw", SIZES["raw"], shard_mb=SEED.run.shard_mb)
    assert named_codecs(cache_knobs(SEED, need, 70 * GB, codec_sizes=MEASURED)) == {rule}
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=MEASURED)
    verdict = budget.predict_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=MEASURED).verdict
    assert plan.fits and plan.changes["codec"] == rule and named_codecs(verdict) == {rule}, (plan, verdict)
    # the plan and the verdict keep the same outputs, so its cache had the room choose_codec is given
    outputs = plan.budget.totals["drive"] - cache_bytes(n, 224, rule, SIZES[rule], shard_mb=SEED.run.shard_mb)
    assert budget.choose_codec(n, 15 * GB - outputs / 0.9, MEASURED) == rule

    monkeypatch.setattr(sys.modules["nblib.codec_sizes"], "codec_sizes", lambda texts, image_size: MEASURED)
    done = run_nblib("budget", "--plan", "--texts", "any", "--drive-quota-gb", "15")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    verdict_line = next(line for line in out.splitlines() if line.startswith("VERDICT"))
    assert named_codecs(verdict_line) == {rule} and f"FITS with codec={rule!r}" in out, out

    texts = tmp_path / "texts.txt"                # cache --codec auto, the same sizes and rates, as 64 texts
    texts.write_text("".join(t.replace("\n", " ") + "\n" for t in nblib.cache.sample_texts(64)), encoding="utf-8")
    monkeypatch.setattr(sys.modules["nblib.cache.format"], "measure_codecs", lambda sample, *a, **k: MEASURED.stats)
    monkeypatch.setattr(sys.modules["nblib.cache.populate"], "disk_free", lambda folder: 70 * GB * 64 / n)
    assert run_nblib("cache", "--texts", str(texts), "--out", str(tmp_path / "cache"), "--size", "32",
                     "--shard-mb", "1", "--workers", "0", "--codec", "auto").returncode == 0
    built = nblib.cache.ShardedImageCache(tmp_path / "cache")
    assert len(built) == 64 and built.codec == rule


def test_the_encode_refusal_names_the_one_rules_codec(monkeypatch, tmp_path):
    workspace = nblib.env.workspace(tmp_path / "drive")          # staging and "Drive" on one 40 GB disk
    monkeypatch.setattr("nblib.disk.disk_free", lambda folder: 40 * GB)
    monkeypatch.setattr("psutil.virtual_memory", lambda: collections.namedtuple("memory", "available")(64 * GB))
    with pytest.raises(nblib.BudgetExceeded) as refused:
        budget.preflight(SEED, workspace, job="encode", device="cpu", codec_sizes=MEASURED)
    assert named_codecs(str(refused.value)) == {"zlib"}, refused.value


@pytest.mark.parametrize("free_gb", [5.0, 9.5, 11.0, 12.0, 70.0])
def test_where_png_decodes_slowest_it_is_chosen_only_when_only_png_fits(free_gb):
    sizes = {"raw": 150_536, "zlib": 6_000, "zstd": 5_500, "png": 4_000}    # png the smallest and the slowest
    measured = CodecSizes(sizes, 224, "measured on 300 texts of mine.txt", True,
                          {"raw": 87_000, "zstd": 12_000, "zlib": 5_000, "png": 1_500}, 300)
    n, free = SEED.run.n_samples, free_gb * GB
    fits = fitting(n, free, sizes)
    need = cache_bytes(n, 224, "raw", sizes["raw"], shard_mb=SEED.run.shard_mb)
    offered = named_codecs(cache_knobs(SEED, need, free, codec_sizes=measured))
    if not fits:
        with pytest.raises(nblib.BudgetExceeded):
            budget.choose_codec(n, free, measured)
        assert not offered
        return
    chosen = budget.choose_codec(n, free, measured)
    assert (chosen == "png") == (fits == ["png"]) and offered == {chosen}, (fits, chosen, offered)


def test_a_borrowed_ratio_is_stated_with_its_value_and_a_measured_one_with_its_text_count():
    zstd = f"estimated ratio {CODEC_RATIO_ESTIMATE['zstd']:.2f} of raw, not measured"
    borrowed = budget.predict_budget(SEED, "t4", drive_quota_gb=15)
    assert "run.codec='zstd'" in borrowed.verdict and zstd in borrowed.verdict, borrowed.verdict     # W1
    assert zstd in str(budget.plan_budget(SEED, "t4", drive_quota_gb=15))
    need = cache_bytes(SEED.run.n_samples, 224, "raw")
    assert zstd in cache_knobs(SEED, need, 70 * GB)
    assert f"{CODEC_RATIO_ESTIMATE['zstd']:.2f} of raw, not measured" in borrowed.lines["drive"][0].why \
        or SEED.run.codec == "raw"
    measured = budget.predict_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=MEASURED).verdict
    assert f"zlib {SIZES['zlib']:,} B/image measured on 300 texts" in measured and "estimated" not in measured
    assert f"cache: zlib {SIZES['zlib']:,} B/image measured on 300 texts of mine.txt" in str(
        budget.plan_budget(SEED, "t4", drive_quota_gb=15, codec_sizes=MEASURED))
    assert "measured on 300 texts" in cache_knobs(SEED, need, 70 * GB, codec_sizes=MEASURED)


def test_nothing_fits_names_the_smallest_choice_not_the_last_codec_tried():
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=5, codec_sizes=MEASURED)
    smallest = min(SIZES, key=SIZES.get)
    assert not plan.fits and f"{smallest} cache" in plan.reason and plan.config.run.codec == smallest, plan


def test_sizes_carry_decode_rates_measured_with_them_and_borrowed_ones_are_labelled():
    measured = measure_codec_sizes(sample_texts_path(), 32, n=20)
    assert set(measured.decode_images_per_s) == set(measured.bytes_per_image) == set(config.CODECS)
    assert all(r > 0 for r in measured.decode_images_per_s.values()) and measured.n_texts == 20
    assert measured.stats["png"]["decode_images_per_s"] == measured.decode_images_per_s["png"]
    borrowed = reference_codec_sizes(224)
    assert borrowed.decode_images_per_s == {c: CODEC_DECODE_ESTIMATE[c] for c in config.CODECS}
    assert "fastest decoding first: raw, zstd, zlib, png (the reference's" in str(borrowed), str(borrowed)
    assert str(MEASURED).endswith("fastest decoding first: raw, zlib, zstd, png (measured on one core)")


def test_the_drive_words_name_the_smaller_codecs_in_the_rules_order():
    words = knob_words(SEED.replace(codec="png"), "drive", codec_sizes=MEASURED)
    assert "the first of zlib, zstd that fits" in words, words      # zlib decodes faster, though zstd is smaller
    assert "by the estimated ratios, not measured" in knob_words(SEED, "drive")


def test_notebook_02_names_every_codec_it_measures():
    cells = json.loads((nblib.cache.sample_texts_path().parents[1] / "notebooks" / "02_cache_population.ipynb")
                       .read_text())["cells"]
    learn = next("".join(c["source"]) for c in cells if "What you will learn" in "".join(c["source"]))
    assert all(codec in learn for codec in config.CODECS), learn
