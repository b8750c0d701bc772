"""The preflight of any model on CUDA (encode --model, train --model): the traced budget of nblib.budget.model_vram,
the one answer, checked before the first batch. No GPU here: the preflight functions are called with a CUDA
device object (torch.device("cuda", 0), "cuda") that nothing touches; the GPU's name and free VRAM, the two
things only a GPU answers, are given by monkeypatching the two functions that ask it.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from conftest import small_cache
from nblib.errors import BudgetExceeded

transformers = pytest.importorskip("transformers")

GB = 1e9


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> str:
    """A tiny ViT at 224 px: its preprocessing resizes the cache's 64 px images."""
    path = tmp_path_factory.mktemp("vit") / "vit.json"
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=224, patch_size=8).to_json_file(path)
    return f"hf:ViTModel:{path}"


@pytest.fixture
def on_a_t4(monkeypatch):
    """This process "has" a Tesla T4 with `free[0]` bytes of free VRAM (only the name and the free memory are faked)."""
    import importlib

    pf = importlib.import_module("nblib.budget.preflight")     # nblib.budget re-exports a function of that name
    free = [15 * GB]
    monkeypatch.setattr(pf, "_gpu_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(pf, "_free_vram", lambda device=None: free[0])
    return free


def _largest(message: str) -> int:
    return int(re.search(r"use --batch-size (\d+) or less", message).group(1))


def test_a_huge_batch_is_refused_with_the_numbers_and_the_largest_batch_that_fits(vit):
    from nblib.budget import model_vram_check

    with pytest.raises(BudgetExceeded) as refused:
        model_vram_check(vit, 100_000, "t4", precision="fp16")
    message = str(refused.value)
    assert re.search(r"needs \d+\.\d\d GB of VRAM", message) and _t4_allows() in message
    largest = _largest(message)
    assert largest > 0
    ok = model_vram_check(vit, largest, "t4", precision="fp16")   # the batch it names passes: one answer
    assert ok.fits and ok.largest_batch == largest


def test_encode_preflight_on_cuda_traces_the_models_loop_and_refuses_what_the_gpu_cannot_hold(
        vit, tmp_path, on_a_t4, caplog):
    import torch

    from nblib.cache import ShardedImageCache
    from nblib.config import preset
    from nblib.encode.run import _preflight, pending_parts, plan_encode

    cache = small_cache(tmp_path / "cache", [f"text {i}" for i in range(24)])
    config = preset("smoke").replace(batch_size=16, checkpoint_every=1, consolidate_every=1)
    run = plan_encode(ShardedImageCache(cache), tmp_path / "run", config, "cpu", model=vit)
    run = dataclasses.replace(run, torch_device=torch.device("cuda", 0))   # a CUDA run; nothing touches CUDA
    pending = pending_parts(run.plan, {"parts": {}})
    with caplog.at_level(logging.INFO, logger="nblib.encode.run"):
        _preflight(run, None, pending, True)                                # an idle T4: fits
    assert "fits" in caplog.text and "at batch 16" in caplog.text
    on_a_t4[0] = 0.05 * GB                                                  # another process holds the GPU
    with pytest.raises(BudgetExceeded, match=r"at batch 16 \(fp16, encoding\) needs 0\.\d\d GB of VRAM beside "
                                             r"the CUDA context but 0\.05 GB is free") as refused:
        _preflight(run, None, pending, True)
    assert re.search(r"fits an idle t4: [\d,]+\)", str(refused.value))


def test_train_preflight_on_cuda_refuses_with_the_micro_batch_it_checked(vit, tmp_path, on_a_t4):
    from test_train import labelled_cache

    from nblib.train import TrainConfig
    from nblib.train.task import ImageTask, vram_preflight

    cache = labelled_cache(tmp_path, 48)
    config = TrainConfig(steps=2, batch_size=8, accumulation=2, device="cuda", precision="fp16")
    task = ImageTask(cache, config, model=vit)
    assert vram_preflight(task, config.replace(device="cpu", precision="fp32")) is None    # no VRAM to check
    on_a_t4[0] = 0.01 * GB                     # the micro-batch's training step, in fp16, checked on a T4
    with pytest.raises(BudgetExceeded, match=r"at batch 4 \(fp16, training\).*per forward pass: --batch-size 8 "
                                             r"is micro-batches of 4"):
        vram_preflight(task, config)


def test_a_module_passed_as_an_object_runs_unchecked_with_a_warning_not_a_crash(on_a_t4, caplog):
    """The trace rebuilds the model from its spec in its own process; an object has none to rebuild from."""
    import torch

    from nblib.budget import model_preflight
    from nblib.models import LoadedModel, Preprocessing

    loaded = LoadedModel(torch.nn.Conv2d(3, 4, 3), "torch.nn.Conv2d", "module", Preprocessing(), None)
    with caplog.at_level(logging.WARNING, logger="nblib.budget.preflight"):
        assert model_preflight(loaded, 8, torch.device("cuda", 0)) is None
    assert "the VRAM of torch.nn.Conv2d is not checked" in caplog.text and "package.module:factory" in caplog.text


def _t4_allows() -> str:
    from nblib.budget.devices import DEVICES

    limit = DEVICES["t4"].vram_bytes
    return f"a t4 allows {0.9 * limit / 1e9:.2f} GB (90% of {limit / 1e9:.2f} GB)"

