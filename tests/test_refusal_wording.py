"""Refusals that name what is wrong (issue 39): a mirror of another run names the keys that differ and their
values, a small full disk's shortfall reads in a unit that shows it, a grouping cap names what the user can
turn, and a rerun with another seed is told that the seed differs, not that the model does.
"""
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from cli_runner import run_nblib
from test_cache_cli import one_error_line
from test_train import labelled_cache
from test_train_models import FACTORY_SOURCE, RESNET

from conftest import importable_models
from nblib.errors import BudgetExceeded, ResumeMismatch
from nblib.units import fmt_bytes


def test_a_mirror_of_a_run_with_another_seed_names_the_seed_and_both_values(tmp_path):
    from nblib.store import DurableStore, ForeignMirror

    mirror = tmp_path / "mirror"
    config = {"profile": "smoke", "steps": 2, "accumulation": 1, "seed": 0}   # not in key order, as a run's is
    first = DurableStore(tmp_path / "a", mirror, identity={"config": config, "cache": "c0ffee"})
    first.close()
    with pytest.raises(ForeignMirror) as info:
        DurableStore(tmp_path / "b", mirror, identity={"config": {**config, "seed": 7}, "cache": "c0ffee"})
    message = str(info.value)
    assert "it differs in config.seed: 0 -> 7)" in message, message
    assert "{'" not in message and "\n" not in message, message


def test_a_small_full_disk_says_how_many_bytes_it_is_short_not_0_00_gb(tmp_path, monkeypatch):
    from nblib.budget import check_disk

    free, need = 300_000, 2_000_000                   # a 1 MB tmpfs, nearly full; a 2 MB cache
    monkeypatch.setattr("nblib.disk.disk_free", lambda folder: free)
    with pytest.raises(BudgetExceeded) as info:
        check_disk(tmp_path, need, what="image cache", knob="free disk on that folder")
    message = str(info.value)
    short = fmt_bytes(math.ceil(need / 0.9 - free))   # the shortfall with the 10% margin, in its own unit
    assert f", {short} short (" in message and short != "0.00 GB", message
    assert f"needs {fmt_bytes(need)} but only {fmt_bytes(free)} is free" in message, message
    assert "0.00 GB" not in message, message


def test_too_many_open_groups_names_what_the_user_can_do_not_a_parameter_without_a_flag(tmp_path):
    from nblib.cache.records import MAX_OPEN_GROUPS

    records = [{"layer_id": k, "x": np.full(4, k, dtype=np.float32)} for k in range(MAX_OPEN_GROUPS + 1)]
    source = tmp_path / "records.pkl"
    source.write_bytes(pickle.dumps(records))
    line = one_error_line(run_nblib("cache", "--records", source, "--out", tmp_path / "shards",
                                    "--group-by", "layer_id"))
    assert f"needs more than {MAX_OPEN_GROUPS} shards open at once" in line, line
    assert "sort the input by 'layer_id'" in line and "write_records(..., max_open_groups=N)" in line, line
    assert "has no flag" in line, line


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with importable_models(tmp_path_factory.mktemp("specs"), RESNET, FACTORY_SOURCE) as folder:
        yield folder


def test_a_rerun_with_another_seed_is_told_the_seed_differs_not_that_the_model_does(tmp_path, models,
                                                                                     one_torch_thread):
    from nblib.train import TrainConfig, train

    cache = labelled_cache(tmp_path / "data", 48)
    config = TrainConfig(steps=2, batch_size=8, save_every=2, backup_every=2, eval_every=2)
    train(cache, tmp_path / "run", config, model="tinyfactory:build")   # its weights are drawn from seed 0
    with pytest.raises(ResumeMismatch) as info:
        train(cache, tmp_path / "run", config.replace(seed=7), model="tinyfactory:build")
    message = str(info.value)
    assert "seed=0, this command asks for seed=7" in message and "another --out" in message, message
    assert "another model" not in message, message


def test_a_text_file_named_tar_is_one_error_line_though_tarfile_writes_five(tmp_path):
    """Red team R5-20: tarfile's 'could not be opened' lists one method per line; the CLI prints one line."""
    fake = tmp_path / "fake.tar"
    fake.write_text("hello\n")
    result = run_nblib("cache", "--wds", fake, "--out", tmp_path / "out")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "is damaged at its start" in result.stderr and "method gz" in result.stderr
