"""Item 7 of issue 19: advice fits the config (never a value already set) and names the knob of the
resource that ran out (a full local disk is not helped by a bigger Drive quota).
"""
from __future__ import annotations

import collections

import pytest

import nblib
from nblib import budget, config
from nblib.budget.advice import knob_words
from nblib.budget.disk import CODEC_RATIO_ESTIMATE

SEED = config.preset("seed_t4")      # float16, raw cache, every output
GB = 1e9


def test_drive_words_never_suggest_a_value_already_set():
    words = knob_words(SEED, "drive")
    assert "float16" not in words and "fewer run.outputs" in words and "compressed run.codec" in words
    zlib_checksums = SEED.replace(codec="zlib", outputs=("checksums",))
    words = knob_words(zlib_checksums.replace(out_dtype="float32"), "drive")
    assert "float16" in words and "fewer run.outputs" not in words
    smallest = min(CODEC_RATIO_ESTIMATE, key=CODEC_RATIO_ESTIMATE.get)
    assert "compressed" not in knob_words(SEED.replace(codec=smallest), "drive")   # nothing smaller to pick


def test_a_local_disk_is_not_helped_by_a_bigger_drive_quota():
    assert "drive_quota_gb" not in knob_words(SEED, "drive", on_drive=False)
    assert "free disk" in knob_words(SEED, "drive", on_drive=False)
    assert "drive_quota_gb" in knob_words(SEED, "drive", on_drive=True)
    assert "drive_quota_gb" not in knob_words(SEED, "local disk") and "run.outputs" in knob_words(SEED, "local disk")


def test_the_preflight_refusal_on_a_local_workspace_names_the_local_knobs(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLIB_OUTPUTS", str(tmp_path / "outputs"))
    workspace = nblib.env.workspace(tmp_path / "drive")     # staging and "Drive" on one local disk
    monkeypatch.setattr("nblib.disk.disk_free", lambda folder: 68 * GB)        # a Colab disk, not this one's
    monkeypatch.setattr("psutil.virtual_memory", lambda: collections.namedtuple("memory", "available")(64 * GB))
    with pytest.raises(nblib.BudgetExceeded) as info:      # 656 GB for the reference job: more than the disk
        budget.preflight(SEED, workspace, job="encode")
    message = str(info.value)
    assert "float16 run.out_dtype" not in message and "drive_quota_gb" not in message, message
    assert "free disk" in message and "run.outputs=" in message, message
    assert "keep_local" not in message, message     # it moves 10 GB of a ~590 GB shortfall (issue 30)


def test_advice_fallback_words_fit_the_config():
    b = budget.predict_budget(SEED, "t4", drive_quota_gb=15)
    drive = next(a for a in b.advice if a.resource == "drive")
    assert "float16" not in drive.fallback


def test_the_disk_advice_asks_for_no_vram_of_the_choices_it_weighs(monkeypatch):
    """Drive and local-disk advice weighs every output choice and dtype by its disk totals alone: no VRAM is
    traced for a choice the advice never prints VRAM of (on a GPU without a table entry, one trace each).
    """
    from nblib.budget import predict

    asked = []
    real = predict.encode_vram
    monkeypatch.setattr(predict, "encode_vram",
                        lambda cfg, *a, **k: asked.append(cfg.run.outputs) or real(cfg, *a, **k))
    b = budget.predict_budget(SEED.replace(out_dtype="float32"), "t4", drive_quota_gb=15)
    assert {"drive", "local disk"} <= {a.resource for a in b.advice} and "run.outputs" in b.verdict, b.verdict
    assert set(asked) == {SEED.run.outputs}, set(asked)


@pytest.mark.parametrize("changes", [dict(outputs=("checksums",)), dict(out_dtype="float32"), dict(codec="png"),
                                     dict(batch_size=10 ** 9, checkpoint_every=7, consolidate_every=7),
                                     dict(outputs=("sketches",), codec="zstd", n_samples=1000)])
def test_the_disk_totals_advice_weighs_are_the_full_budgets(changes):
    """Budget.disk_totals_with (what the disk advice compares) is the full budget's local disk and Drive, for the
    measured sizes, a given bytes_per_image and the estimates alike.
    """
    from nblib.codec_sizes import CodecSizes

    measured = CodecSizes({"raw": 150_536, "png": 20_000, "zstd": 9_000}, 224, "synthetic", True,
                          {"raw": 9e3, "png": 300.0, "zstd": 2e3}, 300)
    for options in ({}, {"codec_sizes": measured}, {"bytes_per_image": 12_345.0}, {"codec": "zlib"}):
        b = budget.predict_budget(SEED, "t4", **options)
        full = b.with_changes(changes).totals
        assert b.disk_totals_with(changes, b.options) == {r: full[r] for r in ("local disk", "drive")}, options
