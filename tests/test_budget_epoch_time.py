"""`budget --model M --train`: the projected T4 time of an epoch (nblib.t4_speed.model_projection, the one T4
training-time function) for the user's sample count, with the floor the input pipeline sets beside it (issue 51).
"""
from __future__ import annotations

import argparse

import pytest

from tests.cli_runner import run_cli
from tests.conftest import small_cache


@pytest.fixture(scope="module")
def trainable():
    from nblib.simulate.train import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)


def _projection(n: int):
    from nblib.models import load_model
    from nblib.t4_speed import model_projection

    return model_projection(load_model("trm:smoke"), 64, "fp16", train=True, n_samples=n)


def test_the_epoch_time_for_samples_is_the_projection_and_names_the_pipeline_command(trainable):
    done = run_cli(["budget", "--model", "trm:smoke", "--device", "t4", "--batch-size", "8", "--train",
                    "--samples", "1437"])
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    p = _projection(1437)
    assert line.startswith("T4 time per epoch (projection")
    assert f"1,437 samples in {p.hours_text()} at {p.rate_text()}" in line, line
    # the command it names is one `python -m nblib` has, with the flags it requires
    assert "run python -m nblib pipeline --cache CACHE --rss-cap-gb 11 to measure it" in line
    helped = run_cli(["pipeline", "--help"])
    assert "--cache" in helped.stdout and "--rss-cap-gb" in helped.stdout


def test_with_a_cache_the_epoch_is_its_training_split_and_the_pipeline_is_measured(trainable, tmp_path):
    from nblib.train.config import TrainConfig
    from nblib.train.data import split

    cache = small_cache(tmp_path / "c", [f"line {i}" for i in range(40)])
    done = run_cli(["budget", "--model", "trm:smoke", "--batch-size", "8", "--train", "--cache", cache])
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    n = len(split(40, TrainConfig.holdout)[0])
    assert n == 32
    assert f"{n:,} samples (the cache's 40 less train's 20% held out) in {_projection(n).hours_text()}" in line
    assert "input pipeline floor" in line and "measured here" in line and "not measured" not in line


def test_without_a_count_it_says_what_it_needs_and_other_devices_are_not_projected():
    from nblib.cli.budget import t4_epoch_line

    args = argparse.Namespace(device="t4", n_samples=None, cache=None, model="trm:smoke", weights=None,
                              precision="fp16", batch_size=8, input="images")
    assert "needs the sample count: --samples N (or --cache CACHE" in t4_epoch_line(args)
    args.device = "l4"
    assert "projected for a T4 only" in t4_epoch_line(args)
    args.device, args.n_samples, args.precision = "t4", 10, "bf16"
    assert "not projected: precision='bf16'" in t4_epoch_line(args)
    args.input = "tokens:128"
    assert "not projected for --input tokens:128" in t4_epoch_line(args)
