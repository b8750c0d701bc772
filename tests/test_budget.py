"""Budget predictions and refusals; the reference figures as data; notebook 01's computed comparison."""
from __future__ import annotations

import shutil

import pytest

from nblib import budget, config, reference
from nblib.config import ModelConfig, preset
from nblib.env import workspace
from nblib.errors import BudgetExceeded, ConfigError
from nblib.lab import memory_budgeting

PRESETS = config.preset_names()


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_equals_the_real_encoder(name):
    torch = pytest.importorskip("torch")
    from nblib.trm import TRMVisionEncoder

    m = preset(name).model
    with torch.device("meta"):            # the real module structure, without filling 19M weights
        encoder = TRMVisionEncoder(m)
    assert budget.param_count(m) == encoder.parameter_count()
    assert budget.param_count(m) == sum(p.numel() for p in encoder.parameters() if p.requires_grad)


def test_param_count_matches_a_hand_count_for_a_tiny_model():
    # dim 4, patch 2 (3*2*2=12 inputs), 2x2 image -> 1 token, 1 layer, mlp 4, 1 capsule, 1 child
    m = ModelConfig(image_size=2, patch=2, dim=4, heads=1, layers=1, capsules=1, children=1,
                    checksum_dim=2, mlp_ratio=4)
    embed = 12 * 4 + 4
    pos, inits = 1 * 4, 2 * 4
    block = 8 + (4 * 12 + 12) + (16 + 4) + 8 + (4 * 16 + 16) + (16 * 4 + 4)
    pool = 4 + (4 * 8 + 8) + (16 + 4)
    children = 16 + 4
    assert budget.param_count(m) == embed + pos + inits + block + 8 + pool + children


def test_seed_t4_disk_lines_follow_from_the_output_shapes():
    b = budget.predict_budget(preset("seed_t4"), "t4")
    drive = {line.name: line.bytes for line in b.lines["drive"]}
    per_image = (12 * 768 + 12 * 32 + 12 * 4 * 768) * 2          # fp16
    assert per_image == 92_928
    assert drive["durable parts"] == 1_907_747 * per_image         # ~177 GB
    assert drive["image cache (raw)"] >= 1_907_747 * 224 * 224 * 3  # ~287 GB raw
    assert round(drive["image cache (raw)"] / 1e9) == 287


def test_fewer_outputs_and_fp16_shrink_the_drive_total():
    cfg = preset("seed_t4")
    full = budget.predict_budget(cfg.replace(out_dtype="float32"), "t4").totals["drive"]
    half = budget.predict_budget(cfg, "t4").totals["drive"]
    sketches = budget.predict_budget(cfg.replace(outputs=("sketches",)), "t4").totals["drive"]
    assert full > half > sketches


def test_too_big_gives_a_verdict_not_an_exception():
    b = budget.predict_budget(preset("seed_t4").replace(batch_size=8192), "t4")
    assert not b.fits
    assert "does NOT fit" in b.verdict and "vram" in b.verdict.lower()


def test_recursion_costs_time_not_memory():
    cfg = preset("seed_t4")
    deep = cfg.replace(H_cycles=6, L_cycles=6)
    a, b = budget.predict_budget(cfg, "t4"), budget.predict_budget(deep, "t4")
    assert b.flops_per_image > 3 * a.flops_per_image
    assert b.totals["vram"] == a.totals["vram"]


def test_math_attention_materializes_scores_flash_does_not():
    cfg = preset("seed_t4").replace(image_size=448)   # 784 tokens: scores dominate
    math_ = budget.predict_budget(cfg, "t4", sdpa_backend="math")
    flash = budget.predict_budget(cfg, "t4", sdpa_backend="flash")
    scores = {line.name: line.bytes for line in math_.lines["vram"]}["attention scores"]
    assert scores == 192 * 8 * 784 ** 2 * (2 + 2 + 1)   # fp16 scores + softmax, bool mask
    assert {line.name: line.bytes for line in flash.lines["vram"]}["attention scores"] == 0
    assert math_.totals["vram"] > flash.totals["vram"]


def test_max_batch_size_fits_and_one_more_does_not():
    cfg = preset("seed_t4").replace(checkpoint_every=1, consolidate_every=1)
    best = budget.max_batch_size(cfg, "t4", margin=0.1)
    assert best > 0
    fits = budget.predict_budget(cfg.replace(batch_size=best), "t4")
    over = budget.predict_budget(cfg.replace(batch_size=best + 1), "t4")
    limit = 0.9 * 15e9
    assert fits.totals["vram"] <= limit < over.totals["vram"] or fits.totals["ram"] <= 0.9 * 11e9 < over.totals["ram"]


def test_plan_finds_a_config_that_fits_or_says_why():
    fits = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=2000)
    assert fits.fits and fits.budget.fits
    none = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=15)
    assert not none.fits and "drive" in none.reason


def test_calibrate_round_trips_the_rate():
    cfg = preset("seed_t4")
    eff = budget.calibrate("t4", 94.0, cfg)
    assert 0 < eff < 1
    assert budget.predict_budget(cfg, "t4", efficiency=eff).samples_per_s == pytest.approx(94.0)


@pytest.mark.parametrize("change, field", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": -4}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"), ({"capsules": 10_000}, "capsules"),
    ({"image_size": 100}, "image_size"),
])
def test_bad_sizes_raise_config_error_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        budget.predict_budget(preset("smoke").replace(**change), "cpu")


def test_unknown_device_raises_config_error():
    with pytest.raises(ConfigError, match="device='tpu'"):
        budget.predict_budget(preset("smoke"), "tpu")


def test_cache_bytes_raw_and_measured():
    assert budget.cache_bytes(10, 224) == 10 * 224 * 224 * 3 + budget.NPY_HEADER_BYTES
    assert budget.cache_bytes(1000, 224, "png", bytes_per_image=20_000) == 20_000_000 + 128
    with pytest.raises(ConfigError, match="n_images"):
        budget.cache_bytes(0, 224)


def test_choose_codec_picks_the_fastest_that_fits():
    stats = {"raw": {"bytes_per_image": 150_528, "decode_images_per_s": 9000},
             "png": {"bytes_per_image": 20_000, "decode_images_per_s": 800},
             "zlib": {"bytes_per_image": 25_000, "decode_images_per_s": 2000}}
    assert budget.choose_codec(1000, int(1e9), stats) == "raw"
    assert budget.choose_codec(100_000, int(5e9), stats) == "zlib"
    assert budget.choose_codec(100_000, int(2.5e9), stats) == "png"
    with pytest.raises(BudgetExceeded, match=r"png.*2\.0 GB.*1\.0 GB"):
        budget.choose_codec(100_000, int(1e9), stats)


def test_check_disk_refuses_more_than_is_free(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    budget.check_disk(tmp_path / "not" / "yet", 1000, what="x", knob="y")
    with pytest.raises(BudgetExceeded, match=r"the cache needs .* GB but only .* free on .*; shrink it"):
        budget.check_disk(tmp_path, free * 2, what="the cache", knob="shrink it")


def test_preflight_refuses_a_cache_larger_than_the_disk(tmp_path):
    ws = workspace(tmp_path / "drive")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(BudgetExceeded, match="image cache"):
        budget.preflight(preset("smoke"), ws, job="cache", disk_bytes=2 * free)
    assert budget.preflight(preset("smoke"), ws, job="cache").fits


def test_preflight_refuses_an_encode_run_that_overflows_disk(tmp_path):
    ws = workspace(tmp_path / "drive")
    huge = preset("smoke").replace(n_samples=10 ** 12, dim=1024, heads=8)
    with pytest.raises(BudgetExceeded, match=r"needs .* GB but only .* GB is free"):
        budget.preflight(huge, ws, device="cpu")
    assert budget.preflight(preset("smoke"), ws, device="cpu") is not None


def test_preflight_refuses_more_ram_than_available(tmp_path):
    import psutil

    ws = workspace(tmp_path / "drive")
    per_batch = budget.output_bytes_per_batch(preset("smoke"))
    batches = int(2 * psutil.virtual_memory().available / per_batch)
    cfg = preset("smoke").replace(n_samples=10_000 * 32, checkpoint_every=batches,
                                  consolidate_every=batches)
    cfg = cfg.replace(n_samples=batches * 32)
    with pytest.raises(BudgetExceeded, match="RAM"):
        budget.preflight(cfg, ws, device="cpu")


def test_reference_comparison_computes_verdicts_from_the_tolerance():
    rows = {row.item: row for row in memory_budgeting.reference_comparison()}
    scores = rows["attention scores (math)"]
    assert memory_budgeting.show_exact(scores.ours, scores.unit) == "236.03 MB"
    assert scores.ratio == pytest.approx(471e6 / 236.03e6, rel=1e-3)
    for item in ("attention scores (math)", "parameters", "RAM: 200 batches fp16", "outputs / batch"):
        assert rows[item].verdict == "wrong", rows[item]
    for item in ("patches / batch", "checkpoints", "weights fp32"):
        assert rows[item].verdict == "right", rows[item]
    for row in rows.values():
        assert row.right == (abs(row.reference / row.ours - 1) <= memory_budgeting.TOLERANCE)
    loose = memory_budgeting.reference_comparison(tolerance=10.0)
    assert all(row.verdict == "right" for row in loose)


def test_reference_comparison_takes_its_reference_values_from_nblib_reference():
    rows = {row.item: row for row in memory_budgeting.reference_comparison()}
    assert rows["parameters"].reference == reference.ANALYSIS["parameters"].value
    assert rows["weights fp32"].reference == (reference.ANALYSIS["weights fp32 (encoder)"].value
                                              + reference.ANALYSIS["weights fp32 (capsules)"].value)
    assert rows["image cache"].ours == budget.cache_bytes(1_907_747, 224, "raw")


def test_reference_summary_counts_the_rows_marked_wrong():
    rows = memory_budgeting.reference_comparison()
    wrong = [row for row in rows if row.verdict == "wrong"]
    summary = memory_budgeting.reference_summary(rows)
    assert summary.startswith(f"{len(wrong)} of {len(rows)} figures")
    assert all(row.item in summary for row in wrong)
    table = memory_budgeting.reference_table()
    assert table.count(" wrong ") == len(wrong) and table.count(" right ") == len(rows) - len(wrong)


def test_reference_figures_are_data_with_a_source_and_a_unit():
    for group in reference.GROUPS.values():
        for name, figure in group.items():
            assert figure.name == name and figure.source and figure.unit
            assert not any(word in f"{figure.note} {figure.name}".lower() for word in ("wrong", "right", "agree"))
    assert reference.T4_SAMPLES_PER_S.value == 94
    assert reference.CHECKPOINT_TABLE["temporary space during a save"].value == (1.5, 2.0)


def test_shuffle_checkpoint_of_250k_samples_is_125_gb_and_its_disk_peak_follows_the_model():
    ck = budget.shuffle_checkpoint(250_000, 500_000, prefetch=0)
    assert ck.checkpoint_bytes == 125 * 10 ** 9
    assert ck.peak_disk_first_save == budget.checkpoint_disk_peak(ck.checkpoint_bytes, keep_previous=False)
    assert ck.peak_disk_keeping_previous == budget.checkpoint_disk_peak(ck.checkpoint_bytes, keep_previous=True)
    assert (ck.peak_disk_first_save, ck.peak_disk_keeping_previous) == (125 * 10 ** 9, 250 * 10 ** 9)
    assert ck.restore_ram_bytes == budget.checkpoint_ram_peak(ck.checkpoint_bytes)
    table = budget.shuffle_checkpoint_table()
    assert [row.buffer_size for row in table][0] == 100 and table[-1].buffer_size == 400_000


def test_checkpoint_disk_peak_is_one_checkpoint_or_two_when_the_previous_is_kept():
    assert budget.checkpoint_disk_peak(1000, keep_previous=False) == 1000
    assert budget.checkpoint_disk_peak(1000, keep_previous=True) == 2000
    with pytest.raises(ConfigError, match="bytes_per_checkpoint"):
        budget.checkpoint_disk_peak(-1, keep_previous=False)


def test_plan_shards_covers_the_file_and_bounds_ram():
    sp = budget.plan_shards(287 * 10 ** 9, 400)
    assert sp.n_shards == 718
    assert sp.shard_bytes * (sp.n_shards - 1) + sp.last_shard_bytes == sp.total_bytes
    assert sp.shard_bytes <= 400e6 and sp.ram_one_at_a_time == 2 * sp.shard_bytes
    with pytest.raises(ConfigError, match="total_bytes"):
        budget.plan_shards(0)


def test_budget_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, nblib.budget; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cli_prints_the_budget_and_refuses_unknown_devices(capsys):
    from nblib.cli import main

    assert main(["budget", "--preset", "smoke", "--device", "cpu"]) == 0
    assert "VERDICT" in capsys.readouterr().out
    assert main(["budget", "--device", "tpu"]) == 2
    assert "device='tpu'" in capsys.readouterr().err


def test_cli_prints_the_reference_table_with_computed_verdicts(capsys):
    from nblib.cli import main

    assert main(["budget", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "ref/ours" in out and " wrong " in out and " right " in out


def test_budget_package_keeps_the_public_names():
    for name in ("predict_budget", "preflight", "plan_budget", "plan_shards", "max_batch_size", "cache_bytes",
                 "choose_codec", "check_disk", "calibrate", "DEVICES", "Budget", "shuffle_checkpoint"):
        assert hasattr(budget, name), name
    assert budget.OUTPUT_CHOICES is config.OUTPUT_CHOICES
