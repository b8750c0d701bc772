"""Record training end to end (issue 38) and labels that follow their texts (issue 39): `train --records` prints a
next step that runs as typed (`predict`), top-k routing targets and soft targets train, padding is masked (a padded
batch's loss is its records' loss one at a time; a model that would see the padding is refused), and `train --texts`
with a shuffled copy of the cache's texts is refused naming the order. Real record shards and caches, tiny models.
"""
from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_nblib
from test_train import labelled_cache

from conftest import importable_models
from nblib.errors import ConfigError
from nblib.train import TrainConfig, train
from nblib.train.records import RecordFields, RecordTask, collate_records, loss_terms
from tests.test_hostile import one_error_line

TRACES = {"hidden": 16, "experts": 8, "layers": 2, "tokens": (3, 12)}
CONFIG = TrainConfig(steps=30, batch_size=16, save_every=10, backup_every=10, eval_every=10, lr=0.05)
POOLING_SOURCE = '''
import torch
from torch import nn


class MaskedMean(nn.Module):
    """A per-record classifier over variable-length records: the mean of its rows, with the padding masked."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, attention_mask=None):
        h = torch.tanh(self.proj(x))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return {"logits": self.head((h * m).sum(1) / m.sum(1))}


class PlainMean(MaskedMean):
    """The same pooling without a mask: it averages the padding's rows in."""

    def forward(self, x):
        return {"logits": self.head(torch.tanh(self.proj(x)).mean(1))}


def masked():
    return MaskedMean()


def plain():
    return PlainMean()
'''


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread: the same bytes in every run."""


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory):
    with importable_models(tmp_path_factory.mktemp("pooling"), {}, POOLING_SOURCE) as folder:
        yield folder


def routing_records(folder: Path, top_k: int | None) -> Path:
    from record_traces import trace_records

    from nblib.cache import write_records

    write_records(trace_records(240, top_k=top_k, **TRACES), folder, shard_mb=0.01, group_by="layer_id")
    return folder


def pooled_records(folder: Path) -> Path:
    """Records of 2-9 rows of 4 features, a label per record: which of the first 3 features has the largest mean."""
    from nblib.cache import write_records

    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((int(rng.integers(2, 10)), 4)).astype(np.float32) for _ in range(120)]
    write_records(({"x": x, "label": int(x[:, :3].mean(0).argmax())} for x in rows), folder, shard_mb=0.002)
    return folder


def test_train_records_prints_a_predict_command_that_runs_as_typed_and_predicts_with_the_final_weights(tmp_path):
    records, run = routing_records(tmp_path / "records", top_k=4), tmp_path / "my run"
    done = run_nblib("train", "--records", records, "--input-key", "hidden_states", "--target-key", "target_routing",
                     "--loss", "ce", "--classes", "8", "--out", run, "--steps", "10", "--batch-size", "16",
                     "--save-every", "10", "--backup-every", "10", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    step = re.search(r"next: (.*)$", done.stdout, re.M).group(1)
    assert "encode" not in step and "TRM" not in step, step
    argv = shlex.split(step)
    assert argv[:3] == ["python", "-m", "nblib"], step
    predicted = run_nblib(*argv[3:])
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    from nblib.cache import RecordShards
    from nblib.cache.record_torch import RecordDataset

    final = torch.load(run / "final.pt", weights_only=True)
    weight, bias = final["state_dict"]["weight"], final["state_dict"]["bias"]
    outputs, inputs = RecordShards(tmp_path / "my run-predictions"), RecordDataset(records, inputs="hidden_states")
    assert len(outputs) == len(inputs) == 240
    for i in (0, 117, 239):
        record, x = outputs[i], inputs[i].float()
        assert record["index"] == i and record["output"].shape == (x.shape[0], 8)
        assert np.allclose(record["output"], (x @ weight.T + bias).numpy(), atol=1e-5)
        assert np.array_equal(record["prediction"], np.argsort(-record["output"], axis=1, kind="stable")[:, :4])


def test_top_k_routing_targets_and_soft_targets_train_and_a_wrong_output_names_its_real_shape(tmp_path):
    top_k = train(routing_records(tmp_path / "top4", top_k=4), tmp_path / "top4-run", CONFIG,
                  fields=RecordFields("hidden_states", "target_routing", "ce", classes=8))
    final = torch.load(tmp_path / "top4-run" / "final.pt", weights_only=True)
    assert (final["targets"], final["top_k"]) == ("top-k", 4)
    assert top_k.last["heldout_loss"] < top_k.first["heldout_loss"]
    assert top_k.last["heldout_accuracy"] > 0.7 > top_k.first["heldout_accuracy"]      # of the 4 experts, found
    assert "chance 50.0%" in str(top_k)                                                # 4 of 8 by guessing
    soft = train(routing_records(tmp_path / "soft", top_k=None), tmp_path / "soft-run", CONFIG,
                 fields=RecordFields("hidden_states", "target_routing", "ce"))
    assert torch.load(tmp_path / "soft-run" / "final.pt", weights_only=True)["targets"] == "probabilities"
    assert soft.last["heldout_loss"] < soft.first["heldout_loss"]
    target = torch.zeros(2, 5, 4, dtype=torch.int64)
    with pytest.raises(ConfigError, match=re.escape("the model's output is [2, 8] where integer targets [2, 5, 4]")):
        loss_terms(torch.zeros(2, 8), target, torch.tensor([5, 5]), "ce")


def test_labels_per_row_against_a_pooled_output_are_not_read_as_top_k(tmp_path, pooling_models):
    from nblib.cache import write_records

    rows = [np.ones((2 + i % 2, 4), np.float32) for i in range(40)]
    write_records(({"x": x, "label": np.zeros(len(x), np.int64)} for x in rows), tmp_path / "rows", shard_mb=0.002)
    with pytest.raises(ConfigError, match="a row repeats an index: if it holds one label per row"):
        train(tmp_path / "rows", tmp_path / "run", CONFIG.replace(batch_size=8), fields=RecordFields("x", "label"),
              model="tinyfactory:masked")


def test_a_padded_batch_has_the_loss_of_its_records_one_at_a_time(tmp_path, pooling_models):
    records = pooled_records(tmp_path / "pooled")
    for fields, model in ((RecordFields("x", "label", "ce"), "tinyfactory:masked"),
                          (RecordFields("x", "x", "mse"), None)):          # per row: padded rows count in no loss
        task = RecordTask(records, CONFIG.replace(batch_size=8), fields, model=model)
        net = task.model.eval()
        items = [task.dataset[i] for i in range(8)]
        batch = collate_records(items)
        assert len(set(batch[3].tolist())) > 3                             # lengths differ: the batch is padded
        singles = [collate_records([item]) for item in items]
        weights = [float(s[2][0]) if task.loss_name == "mse" else 1.0 for s in singles]
        with torch.no_grad():
            padded = float(task.loss(net, *batch[:4]))
            alone = sum(w * float(task.loss(net, *s[:4])) for w, s in zip(weights, singles)) / sum(weights)
        assert padded == pytest.approx(alone, rel=1e-5, abs=1e-6), (fields, padded, alone)


def test_a_model_that_would_average_the_padding_in_is_refused_naming_attention_mask(tmp_path, pooling_models):
    with pytest.raises(ConfigError, match=r"takes no attention_mask: records of \d+ and \d+ rows share a batch"):
        train(pooled_records(tmp_path / "pooled"), tmp_path / "run", CONFIG.replace(batch_size=8),
              fields=RecordFields("x", "label", "ce"), model="tinyfactory:plain")
    assert not (tmp_path / "run" / "final.pt").exists()


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("texts"), 48)


def test_train_texts_a_shuffled_copy_is_refused_naming_the_order_and_an_edited_one_naming_the_texts(
        text_cache, tmp_path):
    texts = Path(json.loads((text_cache / "manifest.json").read_text())["body"]["source"]["path"])
    lines = texts.read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    (tmp_path / "shuffled.jsonl").write_text("".join(lines), encoding="utf-8")
    edited = [lines[0].replace('"text": "', '"text": "x'), *lines[1:]]
    (tmp_path / "edited.jsonl").write_text("".join(edited), encoding="utf-8")
    argv = ["train", "--cache", text_cache, "--steps", "2", "--batch-size", "8", "--no-progress"]
    line = one_error_line(run_nblib(*argv, "--out", tmp_path / "a", "--texts", tmp_path / "shuffled.jsonl"))
    assert "in another order than" in line and f"pass --texts {texts}" in line, line
    line = one_error_line(run_nblib(*argv, "--out", tmp_path / "b", "--texts", tmp_path / "edited.jsonl"))
    assert "are not the ones the cache" in line and "edited or reordered" in line, line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    done = run_nblib(*argv, "--out", tmp_path / "c", "--texts", texts)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_image_runs_next_step_scores_it_as_typed_and_predict_records_refuses_its_weights_in_one_line(
        text_cache, tmp_path):
    run = tmp_path / "image run"
    done = run_nblib("train", "--cache", text_cache, "--out", run, "--steps", "2", "--batch-size", "8",
                     "--save-every", "2", "--backup-every", "2", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    argv = shlex.split(re.search(r"next: (.*)$", done.stdout, re.M).group(1))
    assert argv[:4] == ["python", "-m", "nblib", "predict"] and "--cache" in argv, argv
    scored = run_nblib(*argv[3:])
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert re.search(r"^accuracy [\d.]+% \(\d+ of 48 images", scored.stdout, re.M), scored.stdout
    records, nothing = routing_records(tmp_path / "records", top_k=None), tmp_path / "no run"
    for args, expected in ((["--run", run, "--records", records, "--out", tmp_path / "p"], "weights of an image run"),
                           (["--run", nothing, "--records", records, "--out", tmp_path / "p"], "does not exist"),
                           (["--run", run, "--records", records], "predict needs --out")):
        assert expected in one_error_line(run_nblib("predict", *args))
    assert not (tmp_path / "p").exists()
