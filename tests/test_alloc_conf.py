"""PYTORCH_CUDA_ALLOC_CONF: the budget replays PyTorch's native caching allocator and says so, in one warning line,
where the variable asks for settings it does not replay (nblib.budget.allocator.warn_if_not_native).
"""
from __future__ import annotations

import logging
from importlib import import_module

import pytest

from nblib.budget import allocator

POINT = {"weights": 1, "resident": 1, "workspace": 0, "max_allocated": 2, "reserved_pytorch": 2 << 20,
         "reserved": {"after the first GEMM's output": 2 << 20}, "peak_op": "aten.mm"}


@pytest.fixture
def fake_child(monkeypatch):
    """model_vram's child answers a traced point at once (the warning is the budget's, not the trace's)."""
    mv = import_module("nblib.budget.model_vram")

    def child(job, payload, timeout_s=600.0):
        return {"stream": None, "points": [POINT for _ in payload["batches"]], "nondeterministic": [], "largest": 9}

    monkeypatch.setattr(mv, "run_job", child)
    allocator._warn_once.cache_clear()
    yield mv
    allocator._warn_once.cache_clear()


@pytest.mark.parametrize("value,flagged", [
    ("expandable_segments:True", ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]),
    ("expandable_segments:False, backend:native", []),
    ("max_split_size_mb:128,expandable_segments:false", ["PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128"]),
    ("backend:cudaMallocAsync", ["PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"]),
])
def test_the_settings_the_allocator_model_does_not_replay_are_named(value, flagged):
    assert allocator.unmodelled_settings({"PYTORCH_CUDA_ALLOC_CONF": value}) == flagged
    assert allocator.unmodelled_settings({"PYTORCH_ALLOC_CONF": value}) == [f.replace("_CUDA", "") for f in flagged]


def test_expandable_segments_gets_one_warning_line_naming_the_native_allocator(fake_child, monkeypatch, caplog):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.WARNING, logger="nblib.budget"):
        fake_child.model_vram("hf:AnyModel:none", 3)
        fake_child.model_vram("hf:AnyModel:none", 5)            # a slider's next batch: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "nblib.budget"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the VRAM budget models PyTorch's "
                               "native caching allocator")


def test_the_native_allocator_and_no_setting_say_nothing(fake_child, monkeypatch, caplog):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for value in (None, "expandable_segments:False"):
        if value is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
        with caplog.at_level(logging.WARNING, logger="nblib.budget"):
            fake_child.model_vram("hf:AnyModel:none", 3)
    assert [r for r in caplog.records if r.name == "nblib.budget"] == []


def test_budget_cli_prints_the_warning_as_one_line(fake_child, monkeypatch):
    from cli_runner import run_nblib

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    done = run_nblib("budget", "--model", "hf:AnyModel:none", "--batch-size", "3")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "native caching allocator" in line]
    assert len(lines) == 1 and "expandable_segments:True" in lines[0], done.stderr
