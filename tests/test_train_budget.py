"""The training-memory budget against measurements: autograd's saved tensors, a step's peak RSS in a
fresh process, and the largest batch confirmed under a real memory cap (an allocation that fails).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from nblib.budget.training import (
    accumulation_for,
    largest_batch,
    predict_training,
    saved_activation_bytes,
    trainable_count,
)
from nblib.config import preset

SMOKE = preset("smoke").model


def test_trainable_parameters_are_counted_as_the_model_has_them():
    from nblib.train.model import Classifier

    net = Classifier(SMOKE, 12)
    assert trainable_count(SMOKE, 12) == sum(p.numel() for p in net.parameters() if p.requires_grad)


@pytest.mark.parametrize("batch", [32, 128])
def test_saved_activations_match_what_autograd_keeps_within_10_percent(batch):
    from nblib.train.probe import saved_bytes

    measured = saved_bytes(SMOKE, batch)
    assert abs(saved_activation_bytes(SMOKE, batch) / measured - 1) <= 0.10


def test_only_the_last_outer_cycle_is_saved_so_more_cycles_cost_no_memory():
    more = SMOKE.__class__(**{**SMOKE.__dict__, "H_cycles": 4})
    assert saved_activation_bytes(more, 64) == saved_activation_bytes(SMOKE, 64)
    from nblib.train.probe import saved_bytes

    assert abs(saved_bytes(more, 64) / saved_bytes(SMOKE, 64) - 1) <= 0.02


def test_adamw_holds_two_fp32_moments_per_trained_parameter_and_amp_adds_fp16_copies():
    fp32 = predict_training(SMOKE, 8)
    bf16 = predict_training(SMOKE, 8, precision="bf16")
    assert fp32.line("AdamW moments (fp32)") == 8 * trainable_count(SMOKE, 12)
    assert fp32.line("autocast fp16 weights") == 0 < bf16.line("autocast fp16 weights")
    assert bf16.line("activations saved for backward") < fp32.line("activations saved for backward")


@pytest.mark.slow
def test_a_steps_peak_rss_is_predicted_within_10_percent_where_activations_dominate():
    from nblib.train.probe import step_peak

    measured = step_peak(SMOKE, 1024)
    assert measured.fits, measured.error
    assert measured.delta > measured.rss_before          # the step, not the runtime, dominates here
    predicted = measured.rss_before + predict_training(SMOKE, 1024).step_bytes
    assert abs(predicted / measured.peak_rss - 1) <= 0.10, (predicted, measured)


@pytest.mark.slow
def test_the_budgets_largest_batch_fits_under_a_real_cap_and_a_third_more_does_not():
    from nblib.train.probe import step_peak

    cap = 300 * 2**20
    best = largest_batch(SMOKE, cap, step_only=True)
    assert best > 100
    inside, over = step_peak(SMOKE, best, cap_bytes=cap), step_peak(SMOKE, int(best * 1.35), cap_bytes=cap)
    assert inside.fits, inside.error
    assert not over.fits and "allocate" in over.error


def test_accumulation_reaches_the_target_batch_with_micro_batches_that_fit():
    assert accumulation_for(256, 100) == (3, 85) or accumulation_for(256, 100) == (4, 64)
    steps, micro = accumulation_for(256, 100)
    assert steps * micro == 256 and micro <= 100
    assert accumulation_for(64, 64) == (1, 64)


def test_one_rule_for_fits_the_training_budget_and_the_advice_keep_the_same_margin():
    import inspect

    from nblib.budget import advice, knobs, predict, resources

    assert advice.MARGIN == resources.FIT_MARGIN
    assert inspect.signature(predict.max_batch_size).parameters["margin"].default == resources.FIT_MARGIN
    assert knobs.plan_budget.__kwdefaults__["margin"] == resources.FIT_MARGIN
    cap = 300 * 2**20
    best = largest_batch(SMOKE, cap, step_only=True)
    assert predict_training(SMOKE, best).step_bytes <= cap * (1 - resources.FIT_MARGIN)
    assert predict_training(SMOKE, best + 1).step_bytes > cap * (1 - resources.FIT_MARGIN)


def test_the_checkpoint_table_compares_tf_data_with_the_data_orders_row_and_keeps_counters_out_of_bytes():
    # newcomer P16: the table said 256 bytes for the data order, the ratio used 206 (the JSON), and step 0,
    # epoch 0, best step 0 stood in the bytes column
    import json
    import re

    import torch

    from nblib.budget import shuffle_checkpoint
    from nblib.lab.training import checkpoint_contents
    from nblib.units import fmt_bytes

    state = {"model": {"w": torch.zeros(1000)}, "data_order": json.dumps({"seed": 7, "order": list(range(60))}),
             "step": 30, "epoch": 2, "best": 25}
    text = checkpoint_contents(state)
    row = int(re.search(r"^data order \(nblib shuffle state\)\s+([\d,]+)$", text, re.M).group(1).replace(",", ""))
    assert f"{len(state['data_order']):,} bytes of JSON, {row:,} in the checkpoint (the row above)" in text
    tf = shuffle_checkpoint(250_000, 500_000).checkpoint_bytes
    assert f"against {fmt_bytes(tf)} of shuffle buffer" in text and "ratio:" not in text    # newcomer P23
    assert not re.search(r"^(step|epoch|best step)\s+\d", text, re.M)
    assert "counters (a few bytes each): step 30, epoch 2, best step 25" in text


def test_the_run_report_gives_the_save_cost_as_one_share_of_step_time():
    from nblib.train.loop import TrainReport
    from nblib.units import fmt_duration

    report = TrainReport(out=Path("run"), steps=30, start_step=0, resumed_from="start", history=[], best_step=None,
                         final=None, seconds=2.0, step_seconds=[0.06] * 30, save_seconds=[0.002] * 6,
                         save_waits=[0.0] * 6)
    line = next(s for s in str(report).splitlines() if s.startswith("saves blocked the loop"))
    assert line.count("%") == 1 and f"{report.save_share:.1%} of step time" in line
    assert f"6 saves of {fmt_duration(0.002)} each" in line and f"30 steps of {fmt_duration(0.06)} on average" in line


def test_label_shares_count_the_classes_the_loop_trains_on(tmp_path):
    import json

    from nblib.lab.training import label_shares

    rows = [{"kind": k, "text": t} for k, t in (("a", "hello"), ("a", "world"), ("a", "again"), ("b", "привет"))]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kind, script = label_shares(path).splitlines()
    assert kind.startswith("kind    2 classes (chance 50.0%): each 25.0%-75.0% of the 4 texts, the largest 'a'")
    assert script.startswith("script  2 classes") and "the largest 'latin'" in script
