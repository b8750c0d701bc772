"""No verb writes into, or removes, a folder it reads (issue 52; red team R5-4, R5-22).

- R5-4: `predict --run RUN --records D --out D --overwrite` deleted D's shards and manifest, then failed reading
  them. An --out that is, holds or sits inside an input (of predict, cache, encode, export, train) is now refused
  in one line before anything is touched, and the input's files stay byte-identical; `--overwrite` is never the
  advice.
- R5-22: a healthy folder of the other kind (record shards given to --cache, an image cache to --records) was
  answered "rebuild it with overwrite=True (--overwrite)". Every verb now says what it holds and which flag
  reads it.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from cli_runner import run_nblib
from test_predict_images import COLOURS, cache_of, image_folder

from tests.test_hostile import one_error_line

THREADS = {"OMP_NUM_THREADS": "1"}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (its relative path) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(record shards, a finished train --records run on them, an image cache, its images' folder)."""
    from record_traces import trace_records

    from nblib.cache import write_records

    root = tmp_path_factory.mktemp("safety")
    records = root / "records"
    write_records(trace_records(40, top_k=None, hidden=8, experts=4, layers=2, tokens=(2, 6)), records,
                  shard_mb=0.005)
    run = root / "records-run"
    done = run_nblib("train", "--records", records, "--input-key", "hidden_states", "--target-key",
                     "target_routing", "--loss", "ce", "--classes", "4", "--out", run, "--steps", "2",
                     "--batch-size", "8", "--no-progress", **THREADS)
    assert done.returncode == 0, done.stderr[-3000:]
    images = image_folder(root / "images", COLOURS, 2, seed=0)
    return records, run, cache_of(images, root / "cache"), images


@pytest.mark.parametrize("where", ["is", "sits inside", "holds"])
def test_predict_out_over_its_records_is_refused_in_one_line_and_the_records_stay_byte_identical(folders, where):
    records, run, _, _ = folders
    before = snapshot(records)
    out = {"is": records, "sits inside": records / "predictions", "holds": records.parent}[where]
    line = one_error_line(run_nblib("predict", "--run", run, "--records", records, "--out", out, "--overwrite",
                                    **THREADS))
    assert f"--out {out} {where}" in line and "predict would write into a folder it reads" in line, line
    assert line.endswith("-predictions") and "--overwrite" not in line, line        # an --out beside the input
    assert snapshot(records) == before
    assert not (records / "predictions").exists()


def test_predict_out_inside_its_run_is_refused_and_the_next_step_writes_beside_the_run(folders, tmp_path):
    records, run, _, _ = folders
    line = one_error_line(run_nblib("predict", "--run", run, "--records", records, "--out", run / "predictions",
                                    **THREADS))
    assert f"sits inside --run {run}" in line, line
    assert not (run / "predictions").exists()
    done = run_nblib("predict", "--run", run, "--records", records, "--out", tmp_path / "p", **THREADS)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("verb", ["cache --images", "cache --records", "encode", "encode --mirror", "export",
                                  "train --val"])
def test_every_verbs_out_over_an_input_is_refused_before_anything_is_touched(folders, tmp_path, verb):
    _, _, cache, images = folders
    pickled = tmp_path / "in" / "records.pkl"
    pickled.parent.mkdir()
    pickled.write_bytes(pickle.dumps([{"x": [1.0, 2.0]}, {"x": [3.0, 4.0]}]))
    read, argv = {
        "cache --images": (images, ["cache", "--images", images, "--out", images, "--overwrite", "--no-progress"]),
        "cache --records": (pickled.parent, ["cache", "--records", pickled, "--out", pickled.parent, "--overwrite"]),
        "encode": (cache, ["encode", "--cache", cache, "--out", cache / "encoded", "--profile", "smoke"]),
        "encode --mirror": (cache, ["encode", "--cache", cache, "--out", tmp_path / "e", "--mirror", cache / "m",
                                    "--profile", "smoke"]),
        "export": (cache, ["export", "--cache", cache, "--out", cache, "--overwrite"]),
        "train --val": (cache, ["train", "--cache", tmp_path / "train-cache", "--val", cache, "--out", cache / "run",
                                "--steps", "2", "--profile", "smoke", "--no-progress"]),
    }[verb]
    if verb == "train --val":
        cache_of(images, tmp_path / "train-cache")
    before = snapshot(read)
    line = one_error_line(run_nblib(*argv, **THREADS))
    assert f"{verb.split()[0]} would write into a folder it reads" in line and "--overwrite" not in line, line
    assert snapshot(read) == before


@pytest.mark.parametrize("verb, flag", [("train", "--cache"), ("train", "--records"), ("predict", "--cache"),
                                        ("predict", "--records"), ("encode", "--cache"), ("export", "--cache")])
def test_a_folder_of_the_other_kind_is_named_with_the_flag_that_reads_it_never_overwrite(folders, tmp_path, verb,
                                                                                           flag):
    records, run, cache, _ = folders
    given = records if flag == "--cache" else cache                 # the wrong kind for the flag
    argv = {"train": ["train", flag, given, "--out", tmp_path / "run", "--steps", "2", "--profile", "smoke",
                      *(["--input-key", "hidden_states", "--target-key", "target_routing"] if flag == "--records"
                        else [])],
            "predict": ["predict", "--run", run, flag, given, "--out", tmp_path / "p"],
            "encode": ["encode", "--cache", given, "--out", tmp_path / "e", "--profile", "smoke"],
            "export": ["export", "--cache", given, "--out", tmp_path / "x"]}[verb]
    before = snapshot(given)
    line = one_error_line(run_nblib(*argv, **THREADS))
    expected = (f"{given} holds record shards, not images: read it with --records {given}" if flag == "--cache"
                else f"{given} holds images, not record shards: read it with --cache {given}")
    assert line == f"error: {expected}", line
    assert snapshot(given) == before and not any(tmp_path.iterdir())
