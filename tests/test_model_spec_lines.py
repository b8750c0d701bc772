"""A --model that does not give an image model is one line, and `train` and `budget` print the same one.

Both load the model through `nblib.models.load_model` (budget in its trace's process, whose error comes back as
the same class and line): a factory that raises, a factory that needs an argument, hf: with a config field its
class refuses, hf:DetrModel without timm (its backbone), hf:CLIPModel (its forward takes text first).
"""
from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
from cli_runner import run_nblib
from test_hostile import one_error_line
from test_train import labelled_cache

pytest.importorskip("transformers")

FACTORIES = '''
import torch


def raises():
    raise ValueError("no such width: 7")


def needs(width):
    return torch.nn.Linear(width, 2)
'''
BAD_RESNET = {"model_type": "resnet", "hidden_sizes": "eight"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("specs")
    (root / "spec_factories.py").write_text(textwrap.dedent(FACTORIES))
    (root / "bad_resnet.json").write_text(json.dumps(BAD_RESNET))
    labelled_cache(root / "data", 24)
    return root


CASES = {
    "spec_factories:raises": ("model factory 'spec_factories:raises' raised ValueError: no such width: 7",),
    "spec_factories:needs": ("needs width", "def build(): return needs(width=...)"),
    "hf:ResNetModel:{folder}/bad_resnet.json": ("does not build a ResNetConfig", "hidden_sizes", "fix that field"),
    "hf:DetrModel": ("needs a package that does not import here", "timm"),
    "hf:CLIPModel": ("takes input_ids", "hf:CLIPVisionModel"),
}


@pytest.mark.parametrize("spec", list(CASES))
def test_train_and_budget_answer_a_model_that_does_not_build_in_the_same_one_line(folder, tmp_path, spec):
    if spec == "hf:DetrModel" and importlib.util.find_spec("timm") is not None:
        pytest.skip("timm imports here: DetrModel builds")
    words, spec = CASES[spec], spec.format(folder=folder)
    env = {"PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1"}    # the run, and the trace's process, import it
    train = one_error_line(run_nblib("train", "--cache", folder / "data" / "cache", "--out", tmp_path / "run",
                                     "--steps", "1", "--batch-size", "4", "--model", spec, "--no-progress", **env))
    budget = one_error_line(run_nblib("budget", "--model", spec, "--train", "--batch-size", "2", **env))
    assert train == budget
    assert all(w in train for w in words), train
    assert not (tmp_path / "run" / "checkpoints").exists()
