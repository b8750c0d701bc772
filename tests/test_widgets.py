"""The widget panels rerun the same pure functions when a control changes."""
from __future__ import annotations

import pytest

from nblib import config, widgets


def _control(panel, key):
    rows = [child for child in panel.children if hasattr(child, "children")]
    for row in rows:
        for control in row.children:
            if getattr(control, "description_key", None) == key:
                return control
    raise KeyError(key)


def test_budget_panel_redraws_the_verdict_when_a_knob_changes():
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)
    assert "does NOT fit on t4" in panel.text
    _control(panel, "device").value = "cpu"            # no VRAM: no new trace (another GPU's is ~10 CPU-s)
    assert "on cpu" in panel.text and "on t4" not in panel.text
    _control(panel, "outputs").value = ("checksums",)
    _control(panel, "n_samples").value = 1000
    assert "fits on cpu" in panel.text


def test_budget_panel_reports_an_invalid_combination_instead_of_raising():
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4")
    _control(panel, "consolidate_every").value = 7   # 200 is not a multiple of 7
    assert "not a valid config: run.checkpoint_every=200 is not a multiple" in panel.text


@pytest.mark.parametrize("key", ["batch_size", "H_cycles", "L_cycles", "workers", "out_dtype"])
def test_budget_panel_has_the_promised_controls(key):
    assert _control(widgets.budget_panel(config.preset("smoke"), "cpu"), key) is not None


def test_budget_panel_prints_exactly_predict_budgets_verdict_naming_ram_and_drive_at_batch_900():
    from nblib import budget

    seed = config.preset("seed_t4")
    panel = widgets.budget_panel(seed, "t4", drive_quota_gb=15)
    _control(panel, "batch_size").value = 900
    shown = panel.text.strip().splitlines()[-1]
    b = budget.predict_budget(seed.replace(batch_size=900), "t4", drive_quota_gb=15)
    assert shown == b.verdict
    assert f"run.batch_size={budget.max_batch_size(seed, 't4')}" in shown
    assert "RAM 33.29 > 9.90 GB (90% of 11.00 GB)" in shown
    drive = f"Drive {b.totals['drive'] / 1e9:.2f} > 13.50 GB (90% of 15.00 GB)"
    assert drive in shown and "run.out_dtype" not in shown     # float16 already


def test_panels_and_controls_carry_css_classes_for_the_browser():
    from nblib.lab.shuffle_checkpoints import BytesFit

    panel = widgets.budget_panel(config.preset("smoke"), "cpu")
    assert "nblib-budget-panel" in panel._dom_classes
    assert "nblib-knob-batch_size" in _control(panel, "batch_size")._dom_classes
    fit = BytesFit(bytes_per_element=16_100.0, fixed_bytes=1_000.0, sample_bytes=16_000, symbolic=True)
    shuffle = widgets.shuffle_checkpoint_panel(fit)
    assert "nblib-shuffle-panel" in shuffle._dom_classes
    assert "nblib-knob-buffer_size" in _control(shuffle, "buffer_size")._dom_classes


def test_budget_panel_shows_a_time_readout_and_one_short_repr():
    panel = widgets.budget_panel(config.preset("seed_t4"), "t4", drive_quota_gb=15)
    before = [line for line in panel.text.splitlines() if line.startswith("time ")]
    _control(panel, "n_samples").value = 1000        # a shorter run, the same trace (H_cycles would trace again)
    after = [line for line in panel.text.splitlines() if line.startswith("time ")]
    assert len(before) == len(after) == 1 and before != after and "projection" in after[0]
    assert "\n" not in repr(panel) and "does NOT fit" not in repr(panel)


def test_the_panel_verdict_names_only_knobs_the_panel_has():
    from nblib import budget
    from nblib.lab.memory_budgeting import panel_verdict

    b = budget.predict_budget(config.preset("seed_t4").replace(batch_size=900), "t4", drive_quota_gb=15)
    for advice in b.advice:
        for suggestion in advice.suggestions:
            shown = suggestion.knob.split(".")[-1] in ("batch_size", "outputs", "codec", "drive_quota_gb",
                                                         "checkpoint_every")
            assert (str(suggestion) in panel_verdict(b)) == shown or not shown
    assert "keep_local" not in panel_verdict(b, knobs=("batch_size",)) and "drive_quota_gb" not in \
        panel_verdict(b, knobs=("batch_size",))
    assert "no control of this panel fixes it alone" in panel_verdict(b, knobs=("device",))


def test_pipeline_panel_asks_for_one_knob_and_one_measured_value():
    from nblib.pipeline import SweepTable

    rows = [{"batch_size": b, "prefetch": p, "varied": v, "samples_per_s": r, "runs": (r - 1, r, r + 1),
             "data_wait": 0.1, "startup_s": 0.1, "peak_rss_bytes": 1e8}
            for b, p, v, r in ((32, 2, "base", 100.0), (128, 2, "batch_size", 150.0), (32, 8, "prefetch", 90.0))]
    panel = widgets.pipeline_sweep_panel(SweepTable(knobs=("batch_size", "prefetch"), rows=rows, planned=3))
    knob, value = panel.children[0].children
    assert knob.options == ("batch_size", "prefetch")
    knob.value = "prefetch"
    assert [v for _, v in value.options] == [2, 8]       # only the values measured with the other knobs at base
    value.value = 8
    assert "prefetch=8 (other knobs at the base): 90 samples/s (89-91, 3 runs)" in panel.text


STATE, BEST = 200_000_000, 70_000_000


@pytest.fixture(scope="module")
def training_panel():
    """The 06 panel over the t4 model (its slider's VRAM traced once, before it shows)."""
    from nblib.simulate.train import backward_capability
    from nblib.train.loop import model_config

    ok, why = backward_capability()
    if not ok:
        pytest.skip(f"the panel's VRAM is a trace of a backward pass: {why}")
    return widgets.training_panel(model_config("t4").model, state_bytes=STATE, best_bytes=BEST, ceiling=330.0)


@pytest.fixture(scope="module")
def cli_training_vram(training_panel):
    """The CLI's answer (budget --model trm:t4 --train) at the batches the panel test moves to, asked in the
    environment the panel was made in: a test's own NBLIB_OUTPUTS is part of a trace's key, and would trace again.
    """
    from nblib.budget.model_vram import model_vram

    return {batch: model_vram("trm:t4", batch, train=True) for batch in (128, 64)}


def test_training_panel_prints_the_traced_vram_and_the_t4_time_projection_not_a_cpu_step(training_panel,
                                                                                         cli_training_vram):
    from nblib.budget.training import t4_training_time
    from nblib.train.loop import model_config
    from nblib.units import fmt_duration

    model = model_config("t4").model
    for batch in (128, 64):                                          # 64 is where it starts: a change redraws
        _control(training_panel, "micro_batch").value = batch
        out = training_panel.text
        vram = cli_training_vram[batch]                             # the CLI's answer (budget --model trm:t4 --train)
        assert f"T4 VRAM at micro-batch {batch} (traced" in out and vram.headline() in out
        time = t4_training_time(model, 10_000 * batch)
        assert f"{time.hours_text()} at {time.rate_text()} (projection)" in out
        assert f"ceiling 330 samples/s (simulated roofline): at least {fmt_duration(10_000 * batch / 330)}" in out
    _control(training_panel, "micro_batch").value = vram.largest_batch // 8 * 8 + 8
    assert "does NOT fit" in training_panel.text


def test_training_panel_sizes_drive_and_the_bucket_by_the_one_retention_rule(training_panel):
    # issue 30: the panel's "Drive (last 3 states + best)" computed keep_last * state * 2
    from nblib.budget import training as tb
    from nblib.train.ops import bucket_cost
    from nblib.units import fmt_bytes

    for keep in (5, 3):
        _control(training_panel, "keep_last").value = keep
        out = training_panel.text
        kept = tb.retained_bytes(STATE, BEST, keep)
        assert kept == keep * STATE + tb.BEST_KEPT * BEST
        assert f"Drive (last {keep} states + 1 best):   {fmt_bytes(kept)} " in out
        assert fmt_bytes(tb.retained_bytes(STATE, BEST, keep, saving=True)) in out
        backup = _control(training_panel, "backup_every").value
        cost = bucket_cost(STATE, BEST, steps=10_000, backup_every=backup, keep_last=keep)
        assert cost.stored_bytes == kept and f"{fmt_bytes(kept)} kept" in out


def test_training_panel_backs_up_every_n_steps_as_train_config_takes_it(training_panel):
    from nblib.errors import ConfigError
    from nblib.train import TrainConfig
    from nblib.train.ops import bucket_cost

    _control(training_panel, "save_every").value = 50
    _control(training_panel, "backup_every").value = 120        # not a multiple of save_every
    out = training_panel.text
    with pytest.raises(ConfigError, match="use 100"):          # what TrainConfig says of the same values
        TrainConfig(save_every=50, backup_every=120)
    assert "backup every 100 steps (a multiple of save every 50, as train takes it)" in out
    assert "a lost VM costs at most 100 steps" in out
    batch = _control(training_panel, "micro_batch")
    was, batch.value = batch.value, 8                    # 800 samples: a lost VM costs seconds, which read as seconds
    lost = training_panel.text.split("a lost VM costs at most 100 steps, ")[1].split(" on a T4")[0]
    batch.value = was
    assert lost.endswith(" s)") and "min" not in lost, lost                     # not '0.1 min (0.1-0.2 min)'
    keep = _control(training_panel, "keep_last").value
    assert bucket_cost(STATE, BEST, steps=10_000, backup_every=100, keep_last=keep).line() in out
