"""Notebook 07's lab (nblib.lab.your_model): the model it names, budget against simulation with the largest batch,
the SIGKILL-and-resume demo through the real command line, the train command it prints, and the T4 projection
from the one sourced range. A tiny ViT config; the traces run in the warm fake-CUDA process, so each test is quick.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import small_cache
from nblib.lab import your_model as lab

transformers = pytest.importorskip("transformers")

SIZE = 64          # the smoke profile's image size
FACTORY = """
import torch
from torch import nn


class TinyConv(nn.Module):
    preprocessing = {"size": [32, 32]}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x):
        fmap = torch.relu(self.conv(x))
        return {"fmap": fmap, "pooled": fmap.mean(dim=(2, 3))}


def build():
    return TinyConv()
"""


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return lab.model_spec("smoke", tmp_path_factory.mktemp("model"), SIZE)


def test_the_smoke_model_is_a_tiny_vit_config_at_the_cache_size_and_t4_is_vit_b16(spec):
    path = spec.split(":", 2)[2]
    config = transformers.ViTConfig.from_json_file(path)
    assert spec.startswith("hf:ViTModel:") and config.image_size == SIZE
    assert {k: getattr(config, k) for k in lab.TINY_VIT} == lab.TINY_VIT
    assert lab.model_spec("t4", "unused", 224) == lab.model_spec("full", "unused", 224) == "hf:ViTModel"
    described = lab.describe(spec, SIZE)
    assert "ViTModel" in described and "last_hidden_state" in described and "pooler_output" in described


def test_budget_against_simulation_adds_the_largest_batch_and_judges_it(spec):
    from nblib.budget import model_vram

    rows = lab.budget_vs_simulated(spec, (8,), progress=False)
    largest = lab.largest_batch(rows)
    assert [r.batch for r in rows] == [8, largest] and largest > 8
    assert rows[-1].budget.fits and rows[-1].budget.reserved <= lab.t4_cap()     # the cap the search used
    assert not model_vram(spec, largest + 1, find_largest=False).fits             # the largest: one more does not fit
    for r in rows:
        assert r.simulated.label == "simulated" and r.ratio == r.budget.reserved / r.simulated.max_reserved
        assert r.within == (abs(r.ratio - 1) <= lab.TOLERANCE)
    table = lab.check_table(rows)
    assert "(simulated)" in table and f"{largest:,}" in table
    assert lab.agreement(rows).endswith(str(all(r.within for r in rows)))


def test_kill_and_resume_kills_a_real_cli_run_midway_and_compares_bytes(tmp_path, monkeypatch):
    """Any spec: a factory model here, so the command's processes load torch only (the test stays quick)."""
    (tmp_path / "tinyconv.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    cache = small_cache(tmp_path / "cache", [f"text number {i}" for i in range(40)])
    result = lab.kill_and_resume(cache, tmp_path / "kill", "tinyconv:build", "smoke", 4, after_parts=2,
                                 progress=False)
    assert result.parts_total == 10 and result.n_samples == 40
    assert 0 < result.durable_at_kill < result.n_samples                       # killed mid-run, parts durable
    assert result.identical == {"fmap": True, "pooled": True}
    assert "byte for byte: True" in result.lines() and f"{result.durable_at_kill:,} of 40" in result.lines()


def test_the_printed_train_command_asks_for_the_run_train_makes(spec, tmp_path):
    from nblib.cli.train import _train_args
    from nblib.train import TrainConfig
    from nblib.train.command import config_from_args

    config = TrainConfig(steps=6, batch_size=16, save_every=2, backup_every=2, eval_every=3)
    line = lab.train_command(tmp_path / "cache", tmp_path / "out", spec, config, mirror=tmp_path / "mirror")
    assert line.startswith("python -m nblib train ") and f"--model {spec}" in line
    args = _train_args(line.split()[4:])
    assert config_from_args(args).computing() == config.computing() and args.model == spec
    assert args.mirror == str(tmp_path / "mirror") and args.backup_every == config.backup_every


def test_the_t4_time_is_the_sourced_range_labelled_a_projection(spec):
    from nblib import t4_speed
    from nblib.models import load_model

    text = lab.t4_time(spec, SIZE, t4_speed.SEED_T4_IMAGES)
    expected = t4_speed.model_projection(load_model(spec), SIZE, "fp16", n_samples=t4_speed.SEED_T4_IMAGES)
    assert expected.rate_text() in text and "(projection)" in text and "FlopCounterMode" in text
    assert "if FLOPs bound the run (a floor where" in text      # the time is labelled as the floor it can be
    assert json.dumps(expected.label) == '"projection"'
