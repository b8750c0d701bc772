"""Train, then score (issue 51): `predict --run RUN --cache TEST_CACHE --out DIR` on a run trained by `train --cache`
from a labelled image folder split into train/ and test/ (class subfolders, made with Pillow here). The closing
line's predict command runs as typed, and its printed accuracy, per-class accuracy and confusion matrix agree
with an independent count over predictions.csv; a test cache of a subset of the classes scores the same images
the same; a class the run never saw, an unlabelled cache, `train --val`, and the refusals that need no model
(answered before torch is imported).
"""
from __future__ import annotations

import csv
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_nblib

from conftest import importable_models, subprocess_env
from tests.test_hostile import one_error_line

COLOURS = {"blue": (40, 40, 200), "green": (40, 190, 40), "red": (200, 40, 40)}
FACTORY_SOURCE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """A conv net over 16 px inputs; train puts a Linear head on its pooled output."""

    preprocessing = {"size": [16, 16]}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)

    def forward(self, x):
        return {"pooled": torch.relu(self.conv(x)).mean(dim=(2, 3))}


def build():
    return Tiny()
'''
TRAIN = ["--steps", "6", "--batch-size", "8", "--save-every", "3", "--backup-every", "6", "--eval-every", "3",
         "--profile", "smoke", "--no-progress"]


def image_folder(root: Path, classes: dict, per_class: int, seed: int) -> Path:
    """root/<class>/<i>.png: 64 px images of each class's colour plus noise (Pillow)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, colour in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(np.array(colour) + rng.normal(0, 60, (64, 64, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def cache_of(folder: Path, out: Path) -> Path:
    done = run_nblib("cache", "--images", folder, "--out", out, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread: the same bytes in every run."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, the train --val run's stdout, the run, the test cache): train/ and test/ folders, cached, one run."""
    root = tmp_path_factory.mktemp("scored")
    train_cache = cache_of(image_folder(root / "train", COLOURS, 12, seed=0), root / "train-cache")
    test_cache = cache_of(image_folder(root / "test", COLOURS, 5, seed=1), root / "test-cache")
    done = run_nblib("train", "--cache", train_cache, "--val", test_cache, "--out", root / "run", *TRAIN)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, done.stdout, root / "run", test_cache


def read_predictions(folder: Path) -> list[dict]:
    with open(folder / "predictions.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def printed_counts(stdout: str) -> tuple[int, int, dict]:
    """(right, images) of the printed accuracy line, and {class: (right, images)} of the per-class line."""
    right, total = re.search(r"^accuracy [\d.]+% \((\d+) of (\d+) images", stdout, re.M).groups()
    per_class = re.search(r"^per class: (.*)$", stdout, re.M).group(1)
    classes = {name: (int(a), int(b)) for name, a, b in re.findall(r"(\w+) [\d.]+% \((\d+) of (\d+)\)", per_class)}
    return int(right), int(total), classes


def test_the_closing_lines_predict_command_runs_as_typed_and_its_accuracy_is_what_the_predictions_file_says(
        trained):
    root, stdout, run, test_cache = trained
    command = re.search(r"next: (.*)$", stdout, re.M).group(1)
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "nblib", "predict"] and argv[argv.index("--cache") + 1] == str(test_cache)
    scored = run_nblib(*argv[3:])
    assert scored.returncode == 0, scored.stderr[-3000:]
    out = Path(argv[argv.index("--out") + 1])
    assert out.parent == run.parent                            # beside the run, not inside what predict reads
    rows = read_predictions(out)
    assert len(rows) == 15 and [int(r["index"]) for r in rows] == list(range(15))
    for row in rows:                                            # the label is the image's own subfolder
        assert row["label"] == row["key"].split("/")[0] and row["prediction"] in COLOURS
        scores = [float(row["score"]), float(row["top2_score"]), float(row["top3_score"])]
        assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) < 1e-4
        assert {row["prediction"], row["top2"], row["top3"]} == set(COLOURS)
    right, total, per_class = printed_counts(scored.stdout)
    assert (right, total) == (sum(r["label"] == r["prediction"] for r in rows), len(rows))
    labels = Counter(r["label"] for r in rows)
    hits = Counter(r["label"] for r in rows if r["label"] == r["prediction"])
    assert per_class == {name: (hits[name], labels[name]) for name in COLOURS}
    for name in COLOURS:                                        # the printed confusion row of each class
        counts = [int(c) for c in re.search(rf"^ +\d+ {name}((?: +\d+){{3}})$", scored.stdout, re.M).group(1).split()]
        assert counts == [sum(r["label"] == name and r["prediction"] == p for r in rows) for p in sorted(COLOURS)]
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from nblib.train.evaluate import predict_images

    again = predict_images(run, test_cache, root / "from-python")     # the same from Python
    assert again.correct == right and read_predictions(root / "from-python") == rows


def test_a_test_cache_of_some_of_the_classes_scores_its_images_as_the_full_one_does(trained):
    root, _, run, test_cache = trained
    subset = root / "subset"
    for name in ("red", "blue"):                                # run classes blue, green, red: red moves 2 -> 1
        shutil.copytree(root / "test" / name, subset / name)
    cache_of(subset, root / "subset-cache")
    full = run_nblib("predict", "--run", run, "--cache", test_cache, "--out", root / "full-predictions")
    some = run_nblib("predict", "--run", run, "--cache", root / "subset-cache", "--out", root / "subset-predictions")
    assert full.returncode == 0 and some.returncode == 0, (full.stderr, some.stderr)
    by_key = {r["key"]: r for r in read_predictions(root / "full-predictions")}
    rows = read_predictions(root / "subset-predictions")
    assert len(rows) == 10
    for row in rows:
        same = by_key[row["key"]]
        assert row["label"] == same["label"] == row["key"].split("/")[0]
        assert row["prediction"] == same["prediction"] and abs(float(row["score"]) - float(same["score"])) < 1e-5
    right, total, per_class = printed_counts(some.stdout)
    assert (right, total) == (sum(r["label"] == r["prediction"] for r in rows), 10)
    assert set(per_class) == {"red", "blue"}


def test_a_test_cache_that_lists_the_classes_in_another_order_scores_as_the_full_one_does(trained, tmp_path):
    from PIL import Image

    from nblib.cache import write_images

    root, _, run, test_cache = trained
    order = ["red", "green", "blue"]                            # the run's: blue, green, red
    files = sorted((root / "test").glob("*/*.png"))
    write_images([np.asarray(Image.open(f)) for f in files], tmp_path / "reordered", progress=False,
                 keys=[f"{f.parent.name}/{f.name}" for f in files],
                 side=lambda: {"labels": [order.index(f.parent.name) for f in files], "classes": order})
    full = run_nblib("predict", "--run", run, "--cache", test_cache, "--out", tmp_path / "full")
    other = run_nblib("predict", "--run", run, "--cache", tmp_path / "reordered", "--out", tmp_path / "other")
    assert full.returncode == 0 and other.returncode == 0, (full.stderr, other.stderr)
    by_key = {r["key"]: r for r in read_predictions(tmp_path / "full")}
    for row in read_predictions(tmp_path / "other"):
        same = by_key[row["key"]]
        assert (row["label"], row["prediction"]) == (same["label"], same["prediction"])
        assert row["label"] == row["key"].split("/")[0]
    assert printed_counts(other.stdout) == printed_counts(full.stdout)


def test_a_class_the_run_never_saw_is_refused_in_one_line_and_nothing_is_written(trained, tmp_path):
    _, _, run, _ = trained
    folder = image_folder(tmp_path / "zoo", {"red": COLOURS["red"], "purple": (150, 40, 150)}, 2, seed=2)
    cache = cache_of(folder, tmp_path / "zoo-cache")
    line = one_error_line(run_nblib("predict", "--run", run, "--cache", cache, "--out", tmp_path / "p"))
    assert "1 class(es) the run was not trained on ('purple')" in line and "'blue', 'green', 'red'" in line, line
    assert not (tmp_path / "p").exists()


def test_an_unlabelled_cache_gets_predictions_without_a_label_column_accuracy_or_matrix(trained, tmp_path):
    _, _, run, _ = trained
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted((trained[0] / "test" / "green").glob("*.png"))[:3]:
        shutil.copy(path, flat / path.name)
    cache = cache_of(flat, tmp_path / "flat-cache")
    done = run_nblib("predict", "--run", run, "--cache", cache, "--out", tmp_path / "p", "--top-k", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_predictions(tmp_path / "p")
    assert list(rows[0]) == ["index", "key", "prediction", "score", "top2", "top2_score"]
    assert [r["key"] for r in rows] == ["0.png", "1.png", "2.png"]
    assert "has no labels: no accuracy" in done.stdout and not (tmp_path / "p" / "confusion.png").exists()


def test_train_val_is_refused_in_one_line_with_records_without_labels_or_with_an_unknown_class(trained, tmp_path):
    root, stdout, run, test_cache = trained
    held_out = re.search(r"accuracy [\d.]+% -> ([\d.]+%)", stdout).group(1)      # train's last evaluation ...
    scored = run_nblib("predict", "--run", run, "--cache", test_cache, "--out", tmp_path / "scored")
    assert re.search(r"^accuracy ([\d.]+%)", scored.stdout, re.M).group(1) == held_out   # ... was on --val's images
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(root / "test" / "red" / "0.png", flat / "0.png")
    unlabelled = cache_of(flat, tmp_path / "flat-cache")
    purple = cache_of(image_folder(tmp_path / "p", {"purple": (150, 40, 150)}, 2, seed=3), tmp_path / "p-cache")
    train_cache = root / "train-cache"
    for val, expected in ((unlabelled, "holds images without labels"),
                          (purple, "class(es) the run was not trained on ('purple')")):
        line = one_error_line(run_nblib("train", "--cache", train_cache, "--val", val, "--out", tmp_path / "r",
                                        *TRAIN))
        assert expected in line, line
    assert not (tmp_path / "r").exists()


def test_a_run_of_another_model_is_scored_as_its_training_evaluated_it(trained, tmp_path):
    root, _, _, test_cache = trained
    (tmp_path / "models").mkdir()
    with importable_models(tmp_path / "models", {}, FACTORY_SOURCE):
        done = run_nblib("train", "--cache", root / "train-cache", "--val", test_cache, "--model", "tinyfactory:build",
                         "--out", tmp_path / "tiny", *TRAIN[:-3], "--no-progress")
        assert done.returncode == 0, done.stderr[-3000:]
        argv = shlex.split(re.search(r"next: (.*)$", done.stdout, re.M).group(1))
        scored = run_nblib(*argv[3:])
    assert scored.returncode == 0, scored.stderr[-3000:]
    rows = read_predictions(Path(argv[argv.index("--out") + 1]))
    right, total, _ = printed_counts(scored.stdout)
    assert (right, total) == (sum(r["label"] == r["prediction"] for r in rows), 15)
    held_out = re.search(r"accuracy [\d.]+% -> ([\d.]+%)", done.stdout).group(1)
    assert re.search(r"^accuracy ([\d.]+%)", scored.stdout, re.M).group(1) == held_out


@pytest.mark.parametrize("case", ["no final.pt", "records given to --cache", "--out is --cache"])
def test_predict_refusals_that_need_no_model_answer_before_torch_is_imported(trained, tmp_path, case):
    from record_traces import trace_records

    from nblib.cache import write_records

    root, _, run, test_cache = trained
    records = tmp_path / "records"
    write_records(trace_records(8, top_k=None, hidden=4, experts=2, layers=1, tokens=(2, 3)), records)
    argv = {"no final.pt": ["--run", tmp_path / "none", "--cache", test_cache, "--out", tmp_path / "p"],
            "records given to --cache": ["--run", run, "--cache", records, "--out", tmp_path / "p"],
            "--out is --cache": ["--run", run, "--cache", test_cache, "--out", test_cache]}[case]
    code = ("import sys\nfrom nblib.cli import main\n"
            f"status = main(['predict', *{[str(a) for a in argv]!r}])\n"
            "print(status, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr


def test_a_final_pt_that_is_no_torch_file_is_one_line(trained, tmp_path):
    _, _, _, test_cache = trained
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final.pt").write_bytes(b"\x80\x04not a torch file" * 100)
    line = one_error_line(run_nblib("predict", "--run", tmp_path / "run", "--cache", test_cache, "--out",
                                    tmp_path / "p"))
    assert "cannot be read as a torch file" in line and "pass --run the --out of a finished train run" in line
    assert not (tmp_path / "p").exists()
