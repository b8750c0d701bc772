"""The simulated T4's training step (nblib.simulate.train): the loop's own step on a fake cuda:0,
its live bytes against an independent count.

Skipped, with the reason, where this machine cannot simulate a backward pass (no C++ compiler or
no torch headers for the fake-CUDA shim, or a CUDA build of torch).
"""
from __future__ import annotations

import pytest

from nblib.budget.training import predict_training
from nblib.config import preset
from nblib.errors import ConfigError
from nblib.simulate.train import backward_capability, simulate_train_step

CAN, WHY = backward_capability()
pytestmark = pytest.mark.skipif(not CAN, reason=f"cannot simulate a backward pass here: {WHY}")
SMOKE = preset("smoke").model


def test_the_loops_step_runs_backward_adamw_and_the_gradscaler_on_a_fake_t4():
    run = simulate_train_step(SMOKE, 16, "t4", precision="fp16")
    assert run.label == "simulated" and run.sdpa_backend == "efficient"     # what a T4 (sm_75) runs
    ops = {k.op for k in run.kernels}
    assert "_scaled_dot_product_efficient_attention_backward.default" in ops     # backward ran on the device
    assert "lerp_.Scalar" in ops                       # AdamW's exp_avg update on the device
    assert "_amp_foreach_non_finite_check_and_unscale_.default" in ops            # GradScaler.unscale_
    moments = predict_training(SMOKE, 1).line("AdamW moments (fp32)")
    # between steps the device holds the weights, two fp32 moments per trained parameter and the cuBLAS workspace
    assert run.resident - run.weights >= moments
    assert run.max_reserved >= run.max_allocated >= run.max_live > run.resident
    assert run.step_seconds("h100") < run.step_seconds("t4")


def test_traced_live_bytes_equal_an_independent_count_at_the_end_of_the_forward():
    run = simulate_train_step(SMOKE, 32, "t4", precision="fp32", audit=True)
    # parameters, buffers, AdamW state, GradScaler, autograd's saved tensors (saved_tensors_hooks), input,
    # logits, labels and the cuBLAS workspace, as a union of storages: the trace counts the same bytes
    assert run.audit_traced == run.audit_counted
    # the saved activations are most of what the step holds beyond what stays between steps
    assert run.audit_saved > (run.audit_traced - run.resident) // 2


def test_under_amp_only_autocasts_cached_weight_copies_are_outside_the_independent_count():
    run = simulate_train_step(SMOKE, 32, "t4", precision="fp16", audit=True)
    cached = predict_training(SMOKE, 32, precision="fp16").line("autocast fp16 weights")
    # autocast's cache of fp16 parameter copies that no backward saves (the patch embedding's) is the gap
    assert 0 <= run.audit_traced - run.audit_counted <= cached


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match="no GPU"):
        simulate_train_step(SMOKE, 8, "cpu")
    with pytest.raises(ConfigError, match="precision"):
        simulate_train_step(SMOKE, 8, precision="fp8")
    with pytest.raises(ConfigError, match="steps"):
        simulate_train_step(SMOKE, 8, steps=1)
