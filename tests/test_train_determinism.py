"""Ops torch documents as nondeterministic on CUDA, named from the traced training step before its first step.

The table is read from torch's own docstring of use_deterministic_algorithms; the three names that are not
the snake case of the documented one are checked against what torch dispatches here. The traced step of a
model (the same child trace as the VRAM budget) names an AdaptiveAvgPool2d to 2x2 and a bilinear
F.interpolate, and names nothing for transformers' ResNetModel: its 1x1 pool is a mean in ATen, with the
same outputs and gradients. A refusal says what will happen and what to do; --nondeterministic lets it run
warn-only and says the resume will not be bit-identical.
"""
from __future__ import annotations

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nblib.errors import DeterminismError
from nblib.train.determinism import allowed, check_traced, documented, documented_in

FACTORIES = '''
import torch
import torch.nn.functional as F


class Pool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=4)
        self.pool = torch.nn.AdaptiveAvgPool2d((2, 2))

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


class Up(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=8)

    def forward(self, x):
        return F.interpolate(self.conv(x), scale_factor=2, mode="bilinear").mean((-2, -1))


def pool():
    return Pool()


def up():
    return Up()
'''
RESNET = ('{"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], '
          '"layer_type": "basic"}')


class Ops(TorchDispatchMode):
    """The aten kernels a CPU forward and backward dispatch, as (name, output dtype) pairs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.ops.append((func.__name__, str(getattr(first, "dtype", "none")).replace("torch.", "")))
        return out


def dispatched(fn, *inputs):
    with Ops() as mode:
        fn(*inputs).float().sum().backward()
    return mode.ops


def test_the_table_is_torchs_docstring_of_use_deterministic_algorithms():
    doc = " ".join(torch.use_deterministic_algorithms.__doc__.split())
    table = documented()
    names = {e["name"] for e in table}
    assert {"torch.nn.AdaptiveAvgPool2d", "torch.nn.AdaptiveMaxPool2d", "torch.nn.functional.interpolate"} <= names
    for e in table:
        assert f"`{e['name']}` {e['condition']}".strip() in doc, e
    assert not any(e["name"] == "torch.nn.Conv2d" for e in table)    # listed as made deterministic, not thrown


@pytest.mark.parametrize("name, call", [
    ("torch.nn.functional.interpolate", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    ("torch.nn.functional.grid_sample", lambda x: F.grid_sample(x, torch.zeros(2, 3, 3, 2), align_corners=False)),
    ("torch.nn.AdaptiveAvgPool2d", lambda x: torch.nn.AdaptiveAvgPool2d(2)(x)),
    ("torch.nn.ReflectionPad2d", lambda x: torch.nn.ReflectionPad2d(1)(x)),
    ("torch.nn.NLLLoss", lambda x: F.nll_loss(x.log_softmax(1), torch.zeros(2, 5, 5, dtype=torch.long))),
])
def test_each_documented_layer_is_found_by_the_kernels_torch_dispatches_for_it(name, call):
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    assert name in {f["name"] for f in documented_in(dispatched(call, x))}


def test_a_classifiers_cross_entropy_and_a_one_by_one_pool_are_not_named():
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    assert documented_in(dispatched(lambda t: F.cross_entropy(t.mean((-2, -1)), torch.zeros(4, dtype=torch.long)),
                                    x)) == []
    assert documented_in(dispatched(torch.nn.AdaptiveAvgPool2d(1), x)) == []


def test_a_one_by_one_adaptive_pool_is_a_mean_with_the_same_outputs_and_gradients():
    x = torch.randn(3, 8, 7, 5, dtype=torch.float64, requires_grad=True)
    pooled = torch.nn.AdaptiveAvgPool2d(1)(x)
    (grad,) = torch.autograd.grad((pooled * torch.arange(24.0).view(3, 8, 1, 1)).sum(), x)
    y = x.detach().clone().requires_grad_()
    mean = y.mean((-2, -1), keepdim=True)
    (mean_grad,) = torch.autograd.grad((mean * torch.arange(24.0).view(3, 8, 1, 1)).sum(), y)
    assert torch.equal(pooled, mean) and torch.equal(grad, mean_grad)
    ops = [op for op, _ in dispatched(torch.nn.AdaptiveAvgPool2d(1), x)]
    assert "mean.dim" in ops and not any("adaptive" in op for op in ops)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    from nblib.simulate.train import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("determinism")
    (folder / "ndfactories.py").write_text(textwrap.dedent(FACTORIES))
    (folder / "resnet.json").write_text(RESNET)
    return folder


def test_the_traced_step_names_a_two_by_two_pool_and_interpolate_and_nothing_for_resnet(specs, monkeypatch):
    from nblib.budget.model_vram import model_vram

    monkeypatch.setenv("PYTHONPATH", str(specs))
    monkeypatch.syspath_prepend(str(specs))
    found = {spec: model_vram(spec, 2, "t4", train=True, find_largest=False).nondeterministic
             for spec in ("ndfactories:pool", "ndfactories:up", f"hf:ResNetModel:{specs / 'resnet.json'}")}
    assert [(f["name"], f["op"], f["certain"]) for f in found["ndfactories:pool"]] == [
        ("torch.nn.AdaptiveAvgPool2d", "adaptive_avg_pool2d_backward", True)]
    assert [(f["name"], f["op"]) for f in found["ndfactories:up"]] == [
        ("torch.nn.functional.interpolate", "upsample_bilinear2d_backward")]
    assert found[f"hf:ResNetModel:{specs / 'resnet.json'}"] == ()


POOL = [{"op": "adaptive_avg_pool2d_backward", "name": "torch.nn.AdaptiveAvgPool2d", "certain": True,
         "when": "when attempting to differentiate a CUDA tensor"}]


def test_a_model_with_such_an_op_is_refused_in_one_line_naming_it_and_what_to_do(monkeypatch):
    monkeypatch.delenv("NBLIB_NONDETERMINISTIC", raising=False)
    with pytest.raises(DeterminismError) as err:
        check_traced(POOL, "ndfactories:pool", "cuda")
    text = str(err.value)
    assert "\n" not in text and "torch.nn.AdaptiveAvgPool2d" in text and "RuntimeError" in text
    assert "nn.AvgPool2d(kernel_size=stride=input // output)" in text and "--nondeterministic" in text
    assert "will NOT be bit-identical" in text


def test_the_opt_out_trains_warn_only_and_says_the_resume_will_not_be_bit_identical(monkeypatch, caplog):
    from nblib.train.device import deterministic

    monkeypatch.delenv("NBLIB_NONDETERMINISTIC", raising=False)
    with deterministic("cpu"):
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    with allowed(True), caplog.at_level(logging.WARNING, logger="nblib.train"):
        check_traced(POOL, "ndfactories:pool", "cuda")
        with deterministic("cpu"):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert "will not be bit-identical" in caplog.text and "torch.nn.AdaptiveAvgPool2d" in caplog.text
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


def test_an_op_whose_condition_the_trace_cannot_see_is_a_warning_not_a_refusal(monkeypatch, caplog):
    monkeypatch.delenv("NBLIB_NONDETERMINISTIC", raising=False)
    found = documented_in([("_embedding_bag_dense_backward.default", "float32"), ("cumsum.default", "int64")])
    assert [(f["name"], f["certain"]) for f in found] == [("torch.nn.EmbeddingBag", False)]
    with caplog.at_level(logging.WARNING, logger="nblib.train"):
        check_traced(found, "bag", "cuda")
    assert "mode='max'" in caplog.text


def test_a_cuda_run_of_such_a_model_is_refused_by_its_preflight_before_the_first_step(specs, monkeypatch, tmp_path):
    """The loop's own preflight on a (pretended) T4: the VRAM trace, then the refusal naming the op."""
    import sys

    from test_train import labelled_cache

    import nblib.budget.preflight  # noqa: F401 - its module (nblib.budget's name `preflight` is a function)
    from nblib.train.config import TrainConfig
    from nblib.train.task import ImageTask, vram_preflight

    monkeypatch.setenv("PYTHONPATH", str(specs))
    monkeypatch.syspath_prepend(str(specs))
    monkeypatch.delenv("NBLIB_NONDETERMINISTIC", raising=False)
    preflight = sys.modules["nblib.budget.preflight"]
    monkeypatch.setattr(preflight, "_gpu_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(preflight, "_free_vram", lambda device=None: 14 * 2**30)
    config = TrainConfig(device="cuda", batch_size=4, steps=2)
    task = ImageTask(labelled_cache(tmp_path / "data", 24), config, model="ndfactories:pool")
    with pytest.raises(DeterminismError, match=r"ndfactories:pool on cuda: .*torch\.nn\.AdaptiveAvgPool2d"):
        vram_preflight(task, config)
    with allowed(True):
        assert vram_preflight(task, config).nondeterministic[0]["name"] == "torch.nn.AdaptiveAvgPool2d"
