"""A `gpu` case starts with what the previous case left unreferenced freed (conftest's `free_between_cases`):
a model kept alive only by a reference cycle is collected between two cases, so the next case's CUDA
memory is its own. The cycle is made with the collector paused, so only the fixture can free it.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import free_between_cases

LEFT = {}
NO_GPU = "needs a CUDA GPU: conftest collects around a gpu case only where one is (without one the case skips)"


@pytest.fixture(scope="module", autouse=True)
def _collector_back_on():
    yield
    gc.enable()


def _model_in_a_cycle() -> weakref.ref:
    model = torch.nn.Linear(8, 8)
    model.__dict__["itself"] = model            # a cycle: plain refcounting never frees it
    return weakref.ref(model)


def test_free_between_cases_frees_a_model_held_only_by_a_cycle():
    gc.disable()
    try:
        ref = _model_in_a_cycle()
        assert ref() is not None
        free_between_cases()
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_a_gpu_case_that_leaves_a_model_in_a_cycle():
    gc.disable()                                # on until the next case: only the fixture may collect
    LEFT["model"] = _model_in_a_cycle()
    assert LEFT["model"]() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_the_next_gpu_case_starts_without_it():
    if "model" not in LEFT:
        pytest.skip("runs after test_a_gpu_case_that_leaves_a_model_in_a_cycle")
    gc.enable()
    assert LEFT["model"]() is None
