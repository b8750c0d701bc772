"""Round 6 of "nothing lost, nothing silently wrong" for training (issue 52): R5-9, R5-10, R5-13 and round 4's
leftovers. Each test fails on the code before its fix.
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from nblib.train.store import TrainStore


@pytest.fixture
def cpu_hog():
    """A process spinning on a core beside the test, so the save's timing is the one of a busy machine."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer) -> None:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.arange(8) % 3).backward()
    optimizer.step()


def _moments(optimizer) -> list[dict]:
    return list(optimizer.state.values())


EDITS = {
    "in_place": lambda per_param: per_param["exp_avg"].mul_(0),
    "through_data": lambda per_param: per_param["exp_avg"].data.mul_(0),
    "through_numpy": lambda per_param: per_param["exp_avg"].numpy().__setitem__(slice(None), 0),
    "step_through_data": lambda per_param: per_param["step"].data.__iadd__(100),
}


def _assert_equal(saved, expected, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(saved, expected), where
    elif isinstance(expected, dict):
        assert saved.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(saved[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(saved) == len(expected), where
        for i, (a, b) in enumerate(zip(saved, expected)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert saved == expected, where


@pytest.mark.parametrize("inline", [False, True], ids=["writer_thread", "loops_thread"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_r5_9_a_moment_edited_right_after_an_async_save_never_reaches_its_checkpoint(tmp_path, cpu_hog, edit,
                                                                                      inline):
    """The edit comes right after `save` returns, before the write ends (a busy core beside): the checkpoint is
    the deepcopy taken at the save, whether the save serializes on the writer's thread or the loop's.
    """
    model, optimizer = _job()
    store = TrainStore(tmp_path / "run")
    store.manager._cores.none_spare = lambda: inline         # which of the two async paths this save takes
    store.guard(optimizer)
    for version in (1, 2, 3):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        expected = copy.deepcopy(state)
        store.save(state, version, backup=False)
        for per_param in _moments(optimizer):
            EDITS[edit](per_param)
        _step(model, optimizer)
        store.wait_saves()
        local = store.manager.local
        saved = local.load(local.record_bytes("state", version), "state", version)
        _assert_equal(saved, expected)
    store.close()


def _records_with_a_bad_one(folder, kind: str, bad: str | None):
    """96 records of 3-8 rows of 4 features and a target of `kind`; record 50 broken as `bad` says."""
    import numpy as np

    from nblib.cache import write_records

    rng = np.random.default_rng(0)

    def record(i: int) -> dict:
        rows = 3 + i % 6
        x = rng.standard_normal((rows, 4)).astype(np.float32)
        if kind == "labels":
            y = rng.integers(0, 4, rows)
        elif kind == "top-k":
            y = np.stack([rng.permutation(4)[:2] for _ in range(rows)])
        else:
            y = rng.dirichlet(np.ones(4), rows).astype(np.float32)
        if i == 50:
            if bad == "one_row":
                y = y[:1]
            elif bad == "twice_the_rows":
                y = np.concatenate([y, y])
            elif bad == "repeated_index":
                y[1] = [3, 3]
            elif bad == "negative":
                y[2] = [-0.5, 0.5, 0.5, 0.5]
            elif bad == "sums_to_3":
                y[0] = [1.5, 0.5, 0.5, 0.5]
            elif bad == "nan_input":
                x[1, 2] = np.nan
            elif bad == "class_9_of_4":
                y[1] = 9
            elif bad == "nan_target":
                y[1, 1] = np.nan
        return {"x": x, "y": y}

    write_records((record(i) for i in range(96)), folder, shard_mb=0.002)
    return folder


CASES = {  # bad record: (target kind, what the one line says)
    "one_row": ("labels", "record 50 has 1 target rows (--target-key y [1]) for 5 input rows"),
    "twice_the_rows": ("labels", "record 50 has 10 target rows (--target-key y [10]) for 5 input rows"),
    "repeated_index": ("top-k", "record 50 repeats an index in top-2 row 1 of --target-key y ([3, 3])"),
    "negative": ("probabilities", "record 50 holds a negative probability (-0.5) in --target-key y"),
    "sums_to_3": ("probabilities", "record 50 has a row of --target-key y that sums to 3 (row 0)"),
    "class_9_of_4": ("labels", "record 50 holds class 9 in --target-key y: the model gives 4 classes, 0 to 3"),
    "nan_input": ("labels", "record 50 holds NaN (1 of 20 values) in --input-key x"),
    "nan_target": ("probabilities", "record 50 holds NaN (1 of 20 values) in --target-key y"),
}


@pytest.mark.parametrize("bad", sorted(CASES))
def test_r5_10_train_records_refuses_a_bad_target_after_record_0_in_one_line_naming_the_record(tmp_path, bad):
    from cli_runner import run_nblib
    from test_hostile import one_error_line

    kind, expected = CASES[bad]

    def train(bad_one: str | None, out: str):
        records = _records_with_a_bad_one(tmp_path / f"records-{out}", kind, bad_one)
        return run_nblib("train", "--records", str(records), "--input-key", "x", "--target-key", "y", "--loss", "ce",
                         *([] if kind == "probabilities" else ["--classes", "4"]), "--out", str(tmp_path / out),
                         "--steps", "24", "--batch-size", "16", "--save-every", "8", "--backup-every", "8",
                         "--no-progress", "--lr", "0.01", OMP_NUM_THREADS="1")

    line = one_error_line(train(bad, "run"))
    assert expected in line and "diverged" not in line, line
    good = train(None, "good-run")                         # the same records, none broken: no false refusal
    assert good.returncode == 0, good.stderr[-2000:]


def test_r5_13_a_run_resumed_on_another_number_of_processes_says_so_in_one_line_and_in_train_json(tmp_path):
    """A 1-process run SIGKILLed once step 4 was saved, resumed by a 2-rank torchrun launch (gloo on CPU)."""
    from test_train import labelled_cache
    from train_runs import TWO_RANK_STEPS, run_and_kill, torchrun_cli, train_cli, train_env

    from nblib.manifest import read_manifest
    from nblib.train.loop import REPORT, REPORT_KIND

    cache_dir, out = labelled_cache(tmp_path / "data", 160), tmp_path / "run"
    run_and_kill(train_cli(cache_dir, out, "--steps", str(TWO_RANK_STEPS), "--device", "cpu"), out, after_step=4,
                 extra_s=0.0)
    assert not (out / "final.pt").exists()
    done = subprocess.run(torchrun_cli(cache_dir, out), env=train_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "world size" in line]
    assert len(said) == 1 and said[0].startswith("world size 1 -> 2: the result will not be bit-identical to "
                                                 "either uninterrupted run"), done.stderr[-3000:]
    body = read_manifest(out / REPORT, REPORT_KIND).body
    assert body["world_size"] == 2 and body["world_size_change"] == said[0]
    assert 0 < body["start_step"] < TWO_RANK_STEPS


def test_r4_14_save_every_3_with_the_default_backup_every_trains_and_another_backup_every_is_still_refused(
        tmp_path):
    from cli_runner import run_nblib
    from test_hostile import one_error_line

    from nblib.manifest import read_manifest
    from nblib.train.loop import REPORT, REPORT_KIND

    records = _records_with_a_bad_one(tmp_path / "records", "labels", None)
    argv = ["train", "--records", str(records), "--input-key", "x", "--target-key", "y", "--classes", "4",
            "--steps", "6", "--batch-size", "16", "--save-every", "3", "--no-progress"]
    done = run_nblib(*argv, "--out", str(tmp_path / "run"), OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backups every 9 steps: the default --backup-every 10 follows --save-every 3" in done.stderr
    assert read_manifest(tmp_path / "run" / REPORT, REPORT_KIND).body["config"]["backup_every"] == 9
    line = one_error_line(run_nblib(*argv, "--backup-every", "7", "--out", str(tmp_path / "other")))
    assert "backup_every=7 is not a multiple of save_every=3" in line and "use 6" in line, line


def test_r4_14_group_by_keys_1_and_str_1_are_named_as_the_two_keys_that_collide(tmp_path):
    import pickle

    import numpy as np
    from cli_runner import run_nblib
    from test_hostile import one_error_line

    source = tmp_path / "records.pkl"
    with source.open("wb") as f:
        for i in range(3):
            pickle.dump({1: i, "1": 2 * i, "x": np.ones(3, np.float32)}, f)
    for group_by in (["--group-by", "1"], []):
        line = one_error_line(run_nblib("cache", "--records", str(source), "--out", str(tmp_path / "out"),
                                        *group_by, "--no-progress"))
        assert line == ("error: record 0 has the keys 1 (int) and '1' (str), which are one field name, '1', in the "
                        "shards (field names are strings): rename one of them in the input"), line


def test_r5_11_a_long_double_scalar_field_is_refused_in_one_line_and_its_0_d_array_keeps_every_bit(tmp_path):
    import pickle

    import numpy as np
    from cli_runner import run_nblib
    from test_hostile import one_error_line

    from nblib.cache import write_records
    from nblib.cache.record_reader import RecordShards

    third = np.longdouble(1) / 3
    if np.finfo(np.longdouble).nmant <= np.finfo(np.float64).nmant:
        pytest.skip("numpy's long double is a float64 on this platform: nothing is rounded")
    source = tmp_path / "records.pkl"
    with source.open("wb") as f:
        for _ in range(3):
            pickle.dump({"x": np.ones(3, np.float32), "s": third}, f)
    line = one_error_line(run_nblib("cache", "--records", str(source), "--out", str(tmp_path / "out"),
                                    "--no-progress"))
    assert line.startswith("error: record 0 field 's' is a numpy float") and "np.asarray(value)" in line, line
    write_records(({"x": np.ones(3, np.float32), "s": np.asarray(third)} for _ in range(2)), tmp_path / "arrays",
                  shard_mb=1)
    stored = RecordShards(tmp_path / "arrays")[1]["s"]
    assert stored.dtype == np.longdouble and stored.tobytes() == np.asarray(third).tobytes()


def test_r5_10_a_pooled_target_as_long_as_the_first_records_rows_is_not_read_as_one_per_row(tmp_path):
    """A model that pools each record into 3 values (mse against a 3-value target), whose first record has 3 rows:
    the other records' 6 rows are not refused as "6 input rows for 3 target rows".
    """
    import numpy as np
    from test_train_records import POOLING_SOURCE

    from conftest import importable_models
    from nblib.cache import write_records
    from nblib.train import TrainConfig, train
    from nblib.train.records import RecordFields

    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((6 if i % 7 == 3 else 3, 4)).astype(np.float32) for i in range(60)]
    write_records(({"x": x, "y": x.mean(0)[:3].copy()} for x in rows), tmp_path / "records", shard_mb=0.002)
    (tmp_path / "models").mkdir()
    with importable_models(tmp_path / "models", {}, POOLING_SOURCE):
        report = train(tmp_path / "records", tmp_path / "run", TrainConfig(steps=8, batch_size=8, save_every=4,
                                                                           backup_every=4, eval_every=4),
                       fields=RecordFields("x", "y", "mse"), model="tinyfactory:masked")
    assert report.last["step"] == 8
