"""Training: it learns, its state resumes exactly in-process, a changed resume is refused, the data order
splits over ranks without changing, and the object-store ops work. Real caches, real training steps.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_nblib
from sample_cache import labelled_cache  # noqa: F401  the train tests import it from here

from nblib.errors import ConfigError, ResumeMismatch, StateError
from nblib.train import TrainConfig, train
from nblib.train.data import BatchPlan, labels_for_cache, script_of, split
from nblib.train.state import capture_rng, restore_rng

FAST = TrainConfig(steps=8, batch_size=16, save_every=2, backup_every=4, eval_every=4, warmup_steps=2)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("train"), 240)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread, as the CLI subprocesses run: the same bytes everywhere."""


def weights_of(run: Path) -> dict:
    payload = torch.load(run / "final.pt", weights_only=True)
    return {**payload["state_dict"], **{f"head.{k}": v for k, v in payload["head"].items()}}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_training_learns_held_out_loss_falls_and_accuracy_beats_chance(tmp_path):
    folder = labelled_cache(tmp_path, 400)
    report = train(folder, tmp_path / "run", TrainConfig(steps=40, save_every=20, backup_every=20))
    first, last = report.history[0], report.history[-1]
    chance = 1 / len(report.classes)
    assert last["heldout_loss"] < first["heldout_loss"] - 0.3, report.history
    assert last["heldout_accuracy"] > 2.5 * chance, report.history


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(cache_dir, tmp_path):
    train(cache_dir, tmp_path / "whole", FAST)
    stopped = train(cache_dir, tmp_path / "split", FAST, stop_after=5)     # stops at a save (5 is not one)
    assert stopped.final is None
    resumed = train(cache_dir, tmp_path / "split", FAST)
    assert resumed.start_step == 5 and resumed.resumed_from == "local"
    assert_same_weights(weights_of(tmp_path / "whole"), weights_of(tmp_path / "split"))
    assert [h["step"] for h in resumed.history] == [0, 4, 5, 8]


LOADED_STATE_SCRIPT = """
import os, shutil, sys
from pathlib import Path
import torch
from nblib.lab.training import newest_state

run, action = Path(sys.argv[1]), sys.argv[2]
state = newest_state(run)                                   # notebook 06's load
tensors = list(state["model"].values()) + [s["exp_avg"] for s in state["optimizer"]["state"].values()]
expected = [t.clone() for t in tensors]
newest, older = sorted((run / "checkpoints").glob("state-*.pt"))[::-1][:2]
if action == "cp":
    shutil.copyfile(older, newest)                          # cp: the same file (inode), other bytes
else:
    os.truncate(newest, 0)
print("same" if all(torch.equal(a, b) for a, b in zip(tensors, expected)) else "changed")
"""


@pytest.mark.parametrize("action", ["cp", "truncate"])
def test_a_loaded_state_neither_changes_nor_dies_when_its_file_is_overwritten_or_truncated(cache_dir, tmp_path,
                                                                                           action):
    """A loaded state is read, not mapped: `cp` of another state over its file changes none of its tensors,
    and truncating the file does not kill the reader (a map would: SIGBUS). In a subprocess, which a SIGBUS kills.
    """
    import subprocess
    import sys

    run = tmp_path / "run"
    train(cache_dir, run, FAST, stop_after=4)
    done = subprocess.run([sys.executable, "-c", LOADED_STATE_SCRIPT, str(run), action], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "same"


def test_a_resume_with_another_batch_size_or_precision_is_refused_naming_it(cache_dir, tmp_path):
    train(cache_dir, tmp_path / "run", FAST, stop_after=2)
    with pytest.raises(ResumeMismatch, match=r"batch_size=16.*batch_size=8"):
        train(cache_dir, tmp_path / "run", FAST.replace(batch_size=8))
    with pytest.raises(ResumeMismatch, match=r"precision='fp32'.*precision='bf16'"):
        train(cache_dir, tmp_path / "run", FAST.replace(precision="bf16"))
    resumed = train(cache_dir, tmp_path / "run", FAST.replace(workers=0, save_every=4))  # operational: allowed
    assert resumed.start_step == 2


def test_the_global_batch_is_the_same_on_one_or_two_ranks_and_the_state_is_bytes():
    plan = BatchPlan(np.arange(100, 196), batch_size=8, seed=3)
    for step in (0, 5, 11, 12, 30):
        one = plan.rank_batch(step, 0, 1)
        two = np.concatenate([plan.rank_batch(step, r, 2) for r in range(2)])
        assert np.array_equal(one, two)
        state = plan.state_bytes(step)
        assert isinstance(state, bytes) and len(state) < 300
        assert plan.step_of(state) == step
    epoch = np.concatenate([plan.global_batch(s) for s in range(plan.steps_per_epoch)])
    assert sorted(epoch.tolist()) == list(range(100, 196))                 # each sample once per epoch
    with pytest.raises(StateError):
        BatchPlan(np.arange(100, 196), batch_size=8, seed=4).step_of(plan.state_bytes(3))


def test_rng_states_round_trip_through_a_checkpoint():
    import io

    state = capture_rng()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_a_state_saved_on_two_gpus_resumes_on_one(monkeypatch):
    """The CUDA generators are re-seeded before every step: a state neither needs them nor carries them, and one
    from a 2-GPU run (an older state holds 2 CUDA states) restores on a 1-GPU machine.
    """
    def set_all(states):                                    # torch's: states[i] to device i, IndexError past 1
        if len(states) > torch.cuda.device_count():
            raise IndexError(f"{len(states)} CUDA RNG states for {torch.cuda.device_count()} device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.get_rng_state()] * 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    assert "cuda" not in capture_rng()
    restore_rng({**capture_rng(), "cuda": [torch.get_rng_state()] * 2})


def test_labels_are_the_kind_field_or_the_script_and_must_match_the_cache(cache_dir, tmp_path):
    from nblib.cache import ShardedImageCache
    from nblib.errors import InputError

    cache = ShardedImageCache(cache_dir)
    kinds, classes = labels_for_cache(cache)
    assert len(kinds) == len(cache) and len(classes) == 12
    assert script_of("Привет мир") == "cyrillic" and script_of("123 !?") == "none"
    short = tmp_path / "short.jsonl"
    short.write_text('{"id": 0, "kind": "word", "text": "a"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="1 lines but the cache"):
        labels_for_cache(cache, texts=short)
    train_idx, held = split(len(cache), 0.2)
    assert not set(train_idx) & set(held) and len(train_idx) + len(held) == len(cache)


OPENED: list | None = None          # while a list: every path Python opens (an audit hook: nothing is patched)


def _record_opens(event, args):
    if event == "open" and OPENED is not None and isinstance(args[0], (str, Path)):
        OPENED.append(Path(args[0]).resolve())


def test_a_texts_cache_task_reads_its_texts_file_once_for_labels_and_order(cache_dir):
    """Before: the labels read the file, then the order check read it again (~33 s more for 1.9M texts)."""
    import json
    import sys

    from nblib.train.task import ImageTask

    global OPENED
    texts = Path(json.loads((cache_dir / "manifest.json").read_text())["body"]["source"]["path"]).resolve()
    sys.addaudithook(_record_opens)
    OPENED = []
    try:
        task = ImageTask(cache_dir, TrainConfig())
    finally:
        opened, OPENED = OPENED, None
    assert opened.count(texts) == 1, opened
    assert np.array_equal(task.labels, labels_for_cache(task.cache)[0])


def test_labels_of_a_shuffled_or_edited_copy_of_the_texts_are_refused(cache_dir, tmp_path):
    import json

    from nblib.cache import ShardedImageCache
    from nblib.errors import InputError

    texts = Path(json.loads((cache_dir / "manifest.json").read_text())["body"]["source"]["path"])
    lines = texts.read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    (tmp_path / "shuffled.jsonl").write_text("".join(lines), encoding="utf-8")
    (tmp_path / "edited.jsonl").write_text("".join([lines[0].replace('"text": "', '"text": "x'), *lines[1:]]),
                                           encoding="utf-8")
    cache = ShardedImageCache(cache_dir)
    with pytest.raises(InputError, match=f"in another order than {texts}"):
        labels_for_cache(cache, texts=tmp_path / "shuffled.jsonl")
    with pytest.raises(InputError, match="are not the ones the cache"):
        labels_for_cache(cache, texts=tmp_path / "edited.jsonl")


def test_bad_train_settings_name_the_knob():
    with pytest.raises(ConfigError, match="backup_every=3 is not a multiple of save_every=2"):
        TrainConfig(save_every=2, backup_every=3)
    with pytest.raises(ConfigError, match="fp16"):
        TrainConfig(precision="fp16", device="cpu")


def test_the_fsspec_ops_write_list_read_and_delete_whole_objects():
    from nblib.train.objstore import mirror_target

    root, ops = mirror_target("memory://bucket/run-test")
    ops.write_atomic(root / "a.json", [b"{}"])
    assert ops.listdir(root) == ["a.json"] and ops.read_bytes(root / "a.json") == b"{}"
    with pytest.raises(ValueError):
        ops.write_atomic(root / "b.json", [b"x"], expect_digest="0" * 64)
    assert ops.read_bytes(root / "b.json") is None
    ops.unlink(root / "a.json")
    with pytest.raises(FileNotFoundError):
        ops.unlink(root / "a.json")


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "/nonexistent", "--out", "x", "--steps", "3"], "is not a cache folder"),
    (["--cache", "c", "--out", "x", "--steps", "0"], "not a positive integer"),
    (["--cache", "c", "--out", "x"], "--steps"),
])
def test_bad_command_lines_print_one_error_line_and_exit_2(argv, expected, tmp_path):
    done = run_nblib("train", *argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], done.stderr
