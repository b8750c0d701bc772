"""Budget predictions and refusals; the reference figures as data; notebook 01's computed comparison."""
from __future__ import annotations

import re
import shutil

import pytest

from nblib import budget, config, reference
from nblib.codec_sizes import CodecSizes
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
    assert budget.param_count(m) == sum(p.numel() for p in encoder.parameters())
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
    local = {line.name: line.bytes for line in b.lines["local disk"]}
    assert drive["mirrored parts"] == local["parts still to encode"] >= 1_907_747 * per_image        # ~177 GB
    assert local["consolidated outputs"] >= 1_907_747 * per_image
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
    flash = budget.predict_budget(cfg, "t4", sdpa_backend="efficient")
    scores = 192 * 8 * 784 ** 2 * 4                 # CUDA math runs fp16 in fp32: one fp32 score matrix
    assert math_.totals["vram"] - flash.totals["vram"] >= scores   # the traced loop holds them, efficient never


def test_max_batch_size_fits_and_one_more_does_not():
    cfg = preset("seed_t4").replace(checkpoint_every=1, consolidate_every=1)
    best = budget.max_batch_size(cfg, "t4", margin=0.1)
    assert best > 0
    fits = budget.predict_budget(cfg.replace(batch_size=best), "t4")
    over = budget.predict_budget(cfg.replace(batch_size=best + 1), "t4")
    assert any(fits.totals[r] <= 0.9 * fits.limits[r] < over.totals[r] for r in ("vram", "ram"))


def test_plan_finds_a_config_that_fits_or_says_why():
    fits = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=2000)
    assert fits.fits and fits.budget.fits
    none = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=15)
    assert not none.fits and "drive" in none.reason


def test_plan_without_a_cache_fits_a_free_drive_where_every_cache_does_not():
    cached = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=15)
    cacheless = budget.plan_budget(preset("seed_t4"), "t4", drive_quota_gb=15, cacheless=True)
    smallest = min(budget.CODEC_RATIO_ESTIMATE, key=budget.CODEC_RATIO_ESTIMATE.get)   # named, not the last tried
    assert not cached.fits and f"smallest choice (outputs=('checksums',), float16, {smallest} cache" in cached.reason
    assert cacheless.fits and cacheless.changes == {"outputs": ("checksums",), "cache": budget.NO_CACHE}
    lines = {line.name: line.bytes for line in cacheless.budget.lines["drive"]}
    assert lines["image cache (none)"] == 0 and cacheless.budget.totals["drive"] <= 0.9 * 15e9
    assert budget.cache_bytes(10, 224, budget.NO_CACHE) == 0


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
    from nblib.cache.format import CHECKSUM_BYTES  # a raw image is its pixels and the checksum written beside it

    assert budget.cache_bytes(10, 224) == 10 * (224 * 224 * 3 + CHECKSUM_BYTES) + budget.NPY_HEADER_BYTES
    assert budget.cache_bytes(1000, 224, "png", bytes_per_image=20_000) == 20_000_000 + 128
    with pytest.raises(ConfigError, match="n_images"):
        budget.cache_bytes(0, 224)


def test_choose_codec_picks_the_fastest_that_fits():
    stats = CodecSizes({"raw": 150_528, "png": 20_000, "zlib": 25_000}, 224, "synthetic", True,
                       {"raw": 9000, "png": 800, "zlib": 2000})
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
    # one answer: the row is what math SDPA adds to the traced peak of the encode loop on the T4 (predict_budget's
    # VRAM line with sdpa_backend="math" less the default kernel's), not a closed form beside the trace
    seed = preset("seed_t4")
    peak = {s: memory_budgeting.activations_at_peak(budget.predict_budget(seed, "t4", sdpa_backend=s))
            for s in ("math", None)}
    assert scores.ours == peak["math"] - peak[None] > 0
    assert rows["activation peak"].ours == peak[None]
    for item in ("parameters", "RAM: 200 batches fp16", "outputs / batch"):
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
    assert reference.ANALYSIS["samples per second"].value == 94
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


@pytest.mark.two_doors
def test_cli_prints_the_budget_and_refuses_unknown_devices(door):
    from cli_runner import run_cli

    printed = run_cli(["budget", "--preset", "smoke", "--device", "cpu"], door)
    assert printed.returncode == 0 and "VERDICT" in printed.stdout, printed
    refused = run_cli(["budget", "--device", "tpu"], door)
    assert refused.returncode == 2 and "device='tpu'" in refused.stderr, refused


@pytest.mark.two_doors
def test_cli_prints_the_reference_table_with_computed_verdicts(door):
    from cli_runner import run_cli

    done = run_cli(["budget", "--reference"], door)
    assert done.returncode == 0 and "ref/ours" in done.stdout and " wrong " in done.stdout
    assert " right " in done.stdout


def test_budget_package_keeps_the_public_names():
    for name in ("predict_budget", "preflight", "plan_budget", "plan_shards", "max_batch_size", "cache_bytes",
                 "choose_codec", "check_disk", "calibrate", "DEVICES", "Budget", "shuffle_checkpoint"):
        assert hasattr(budget, name), name
    assert budget.OUTPUT_CHOICES is config.OUTPUT_CHOICES


# ------------------------------------------------------------------ advice that fits the config


def _run_value(cfg, knob: str):
    return getattr(cfg.run, knob.removeprefix("run.")) if knob.startswith("run.") else None


def test_batch_900_on_t4_names_the_ram_and_drive_knobs_with_the_batch_that_fits():
    import ast

    seed = preset("seed_t4")
    b = budget.predict_budget(seed.replace(batch_size=900), "t4", drive_quota_gb=15)
    assert {a.resource for a in b.advice} == {"ram", "drive", "local disk"}   # the run folder: every part, outputs
    best = budget.max_batch_size(seed, "t4")
    ram_gb, drive_gb = b.totals["ram"] / 1e9, b.totals["drive"] / 1e9
    assert f"RAM {ram_gb:.2f} > 9.90 GB (90% of 11.00 GB): run.batch_size={best} (the largest" in b.verdict
    # no knob of the run brings 658 GB under 15 GB: it says so with the smallest choice, then the Drive that holds it
    closing = "no knob of the run closes it: even run.outputs="
    assert f"Drive {drive_gb:.2f} > 13.50 GB (90% of 15.00 GB): {closing}" in b.verdict
    ram = next(a for a in b.advice if a.resource == "ram")
    by_knob = {s.knob: s for s in ram.suggestions}
    assert by_knob["run.batch_size"].value == best

    # the property, not a number the code printed: the suggested batch fits VRAM and RAM with the
    # 10% margin, and the next batch does not
    def fits(batch):
        p = budget.predict_budget(seed.replace(batch_size=batch), "t4")
        return all(p.totals[res] <= 0.9 * p.limits[res] for res in ("vram", "ram"))
    assert fits(best) and not fits(best + 1), best
    # the suggested Drive quota is the smallest whole GB that holds the smallest choice with the 10% margin (one
    # Drive size, the plan's too: issue 53), and at that quota with those knobs Drive is no longer over
    quota = int(re.search(r"drive_quota_gb=(\d+)", b.verdict).group(1))
    knobs = re.search(r"even run\.outputs=(\(.*?\)) and run\.codec='(\w+)' together leave Drive ([\d.,]+) GB",
                      b.verdict)
    smallest = float(knobs.group(3))
    assert 0.9 * (quota - 1) < smallest <= 0.9 * quota + 0.005, (quota, smallest)
    smallest_run = seed.replace(batch_size=900, outputs=ast.literal_eval(knobs.group(1)), codec=knobs.group(2))
    at_quota = budget.predict_budget(smallest_run, "t4", drive_quota_gb=quota)
    assert "drive" not in {a.resource for a in at_quota.advice}, at_quota.verdict
    every = by_knob["run.checkpoint_every"]
    cons = int(every.also.split("=")[1]) if every.also else seed.run.consolidate_every
    for fixed in (seed.replace(batch_size=best),
                  seed.replace(batch_size=900, checkpoint_every=every.value, consolidate_every=cons)):
        assert budget.predict_budget(fixed, "t4").totals["ram"] <= 0.9 * b.limits["ram"]


def test_the_verdict_never_suggests_float16_to_a_float16_config():
    for dtype in ("float16", "float32"):
        verdict = budget.predict_budget(preset("seed_t4").replace(out_dtype=dtype), "t4").verdict
        assert ("run.out_dtype='float16'" in verdict) == (dtype == "float32"), verdict


GRID = [dict(batch_size=b, out_dtype=d, outputs=o, codec=c, checkpoint_every=ck, consolidate_every=co)
        for b in (8, 192, 900, 4000) for d in ("float16", "float32")
        for o in (config.OUTPUT_CHOICES[0], config.OUTPUT_CHOICES[3], config.OUTPUT_CHOICES[4])
        for c in ("raw", "png") for ck, co in ((200, 50), (1, 1), (1000, 50))]


@pytest.mark.parametrize("device,quota", [("t4", 15), ("t4", 2000), ("cpu", 100), ("a100-40gb", 15)])
def test_no_suggestion_equals_the_value_already_set_and_each_fitting_one_fits(device, quota):
    seed = preset("seed_t4")
    advised = 0
    # off the T4, seed_t4's outputs and dtype (the shipped trace table's: the T4 cases run every other one's trace,
    # and the advice reads a device only through its limits); every batch, codec and cadence
    grid = GRID if device in ("t4", "cpu") else [
        k for k in GRID if (k["outputs"], k["out_dtype"]) == (seed.run.outputs, seed.run.out_dtype)]
    for knobs in grid:
        cfg = seed.replace(**knobs)
        b = budget.predict_budget(cfg, device, drive_quota_gb=quota)
        over = {r for r, u in b.usage.items() if u > 1}
        assert over <= {a.resource for a in b.advice}, (knobs, b.verdict)   # every resource over is named
        for advice in b.advice:
            for s in advice.suggestions:
                advised += 1
                assert s.value != s.current, (knobs, str(s))
                current = {"drive_quota_gb": quota}.get(s.knob, _run_value(cfg, s.knob))
                assert s.current == current, (knobs, str(s))
                if s.knob in ("run.batch_size", "run.checkpoint_every", "run.consolidate_every"):
                    changes = {s.knob.removeprefix("run."): s.value}
                    if s.also:
                        name, value = s.also.removeprefix("run.").split("=")
                        changes[name] = int(value)
                    after = budget.predict_budget(cfg.replace(**changes), device, drive_quota_gb=quota)
                    assert after.totals[advice.resource] <= 0.9 * b.limits[advice.resource], (knobs, str(s))
    assert advised > 2 * len(grid) // 3, advised     # most configs are advised something


def test_drive_items_per_folder_gives_the_checkpoint_cadence_and_the_shard_size_that_fit():
    seed = preset("seed_t4")
    b = budget.predict_budget(seed.replace(checkpoint_every=1, consolidate_every=1), "t4", drive_quota_gb=2000)
    run_folder = next(c for c in b.drive_limits if c.name == "items in the run folder")
    assert run_folder.crossed and run_folder.need == seed.run.n_batches + 4 and run_folder.limit == 2000
    assert "Drive items in the run folder 9,941 > 2,000: run.checkpoint_every>=5" in b.verdict
    assert "drive" not in b.over          # the bytes fit; the folder does not
    every = budget.smallest_checkpoint_every(seed.replace(checkpoint_every=1, consolidate_every=1))
    fixed = budget.predict_budget(seed.replace(checkpoint_every=every, consolidate_every=1), "t4", drive_quota_gb=2000)
    assert not any(c.crossed for c in fixed.drive_limits) and "Drive items" not in fixed.verdict
    small_shards = budget.predict_budget(seed.replace(shard_mb=64), "t4", drive_quota_gb=2000)
    cache_folder = next(c for c in small_shards.drive_limits if c.name == "items in the cache folder")
    assert cache_folder.crossed and "run.shard_mb>=" in cache_folder.knob
    shard_mb = int(cache_folder.knob.split(">=")[1].split()[0])
    assert budget.cache_shards(seed.replace(shard_mb=shard_mb)) + 1 <= budget.FOLDER_ITEMS_LIMIT


def test_drive_daily_upload_cap_gives_the_days_and_the_outputs_that_fit():
    fp32 = preset("seed_t4").replace(out_dtype="float32", n_samples=3_000_000)    # the cache and the parts: ~1 TB
    upload = next(c for c in budget.predict_budget(fp32, "t4", drive_quota_gb=2000).drive_limits
                  if c.name == "uploads per day")
    assert upload.crossed and upload.limit == 750e9 == reference.DRIVE["upload per day"].value
    assert upload.need == budget.uploaded_bytes(fp32) > 750e9
    assert "over 2 days" in upload.knob and "run.out_dtype='float16'" in upload.knob
    outputs = eval(upload.knob.split("run.outputs=")[1].split(" (")[0])  # noqa: S307 (a tuple literal we wrote)
    assert budget.uploaded_bytes(fp32.replace(outputs=outputs)) <= 750e9
    fp16 = budget.predict_budget(preset("seed_t4"), "t4", drive_quota_gb=2000)
    assert not any(c.crossed for c in fp16.drive_limits)


def test_the_default_drive_quota_is_the_free_quota_from_the_reference():
    b = budget.predict_budget(preset("seed_t4"), "t4")
    assert b.limits["drive"] == reference.DRIVE["free quota"].value == 15e9


def test_plan_never_picks_more_parts_than_a_drive_folder_takes():
    plan = budget.plan_budget(preset("seed_t4").replace(checkpoint_every=1, consolidate_every=1), "t4",
                              drive_quota_gb=2000)
    assert plan.fits and plan.config.run.checkpoint_every >= 5
    assert not any(c.crossed for c in plan.budget.drive_limits)


def test_preflight_refuses_a_plan_that_crosses_a_drive_limit_on_drive(tmp_path):
    ws = workspace(tmp_path / "drive")
    many_parts = preset("smoke").replace(n_samples=3000 * 32, batch_size=32, checkpoint_every=1,
                                         consolidate_every=1)
    with pytest.raises(BudgetExceeded, match=r"items in the run folder 3,004 > 2,000: run.checkpoint_every>=2"):
        budget.preflight(many_parts, ws, device="cpu", drive_limits=True)
    budget.preflight(many_parts, ws, device="cpu", drive_limits=False)          # a local folder: no such limit
    budget.preflight(many_parts, ws, device="cpu")                              # not under /content/drive
    budget.preflight(many_parts.replace(checkpoint_every=2), ws, device="cpu", drive_limits=True)
    with pytest.raises(BudgetExceeded, match=r"items in the cache folder .* run.shard_mb>="):
        budget.preflight(preset("smoke").replace(n_samples=3_000_000, shard_mb=1), ws, job="cache",
                         drive_limits=True)


def test_the_full_runs_disk_choices_are_judged_by_the_budgets_local_disk_and_the_one_margin():
    """Notebook 03's disk table, figure and conclusion: a choice fits the local disk exactly when the budget of
    that choice does (parts + the consolidated copy, within 90%), not when its parts alone are under the disk.
    """
    from nblib.lab import streaming_encoding

    choices = streaming_encoding.full_run_disk()
    assert len(choices) == len(config.OUTPUT_CHOICES) + 1
    for c in choices:
        outs, dtype = c.label.split()
        b = budget.predict_budget(preset("seed_t4").replace(outputs=tuple(outs.split("+")), out_dtype=dtype), "t4")
        assert ("t4 local disk" in c.fitting) == ("local disk" not in b.over), c
        assert c.needs["t4 local disk"] == b.totals["local disk"] >= 2 * c.outputs_bytes - 2 ** 20, c
    pair = next(c for c in choices if c.label == "sketches+checksums float16")
    assert pair.outputs_bytes < pair.limits["t4 local disk"] and "t4 local disk" not in pair.fitting
    verdict = streaming_encoding.disk_verdict(choices)
    every = [c.label for c in choices if len(c.fitting) == len(c.needs)]
    assert verdict.startswith(f"fit every disk: {', '.join(every)};"), verdict


def test_the_raw_cache_has_one_size_per_image_estimated_or_measured():
    """The raw cache's bytes per image (pixels and the checksum the cache writes beside each image) is one
    answer: budget.cache_bytes without a measurement, the measured CodecSizes, its no-texts fallback and the
    budget's image-cache line with either all give the same bytes (01 printed 287.17 and 287.18 GB).
    """
    from nblib import cache
    from nblib.codec_sizes import measure_codec_sizes, reference_codec_sizes

    size, n = 32, 1_907_747
    measured = measure_codec_sizes(cache.sample_texts_path(), size, n=2, codecs=("raw",))
    per_image = measured.bytes_per_image["raw"]
    assert per_image == reference_codec_sizes(size).bytes_per_image["raw"] == budget.raw_bytes_per_image(size)
    assert budget.cache_bytes(n, size, "raw") == budget.cache_bytes(n, size, "raw", per_image)
    seed = preset("seed_t4")
    lines = [budget.predict_budget(seed, "t4", **kw).lines["drive"][0].bytes
             for kw in ({}, {"codec_sizes": measure_codec_sizes(cache.sample_texts_path(), 224, n=2, codecs=("raw",))})]
    assert lines[0] == lines[1], lines
