"""Training on inputs other than images (issue 49): `budget --model hf:BertModel:... --input tokens:LENGTH --train`
and the CUDA preflight of `train --records` trace the records' own step (nblib.train.traced.record_batch: the
RecordNet, its attention mask from the lengths, the run's loss), where they were refused or left unchecked. A BERT
trains and predicts on records of token ids with no wrapper. Real record shards, a tiny BertModel from its config.
"""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert(traced_bert) -> str:
    return traced_bert


@pytest.fixture(scope="module")
def token_records(tmp_path_factory):
    """Records of 5-40 token ids and a label each (which third of the vocabulary holds the most of them)."""
    from nblib.cache import write_records

    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 200, int(rng.integers(5, 41))).astype(np.int64) for _ in range(96)]
    folder = tmp_path_factory.mktemp("tokens") / "records"
    write_records(({"ids": x, "label": int(np.bincount(x // 67, minlength=3).argmax())} for x in ids), folder,
                  shard_mb=0.002)
    return folder, max(len(x) for x in ids)


def _direct(payload: dict, batches) -> list:
    """The budget of `payload`'s job traced at each batch itself (no line through three traces)."""
    from nblib.budget.devices import device_preset

    mv = importlib.import_module("nblib.budget.model_vram")
    direct = {**payload, "batches": list(batches), "cap": mv.reserved_cap("t4"), "search": False,
              "max_batch": max(batches), "replay": False}
    points = mv.trace_child(direct)["points"]
    return [mv._budget(direct, device_preset("t4"), b, p, None) for b, p in zip(batches, points)]


def _lines(budgets) -> list:
    return [[(line.name, line.bytes) for line in v.lines] for v in budgets]


def test_a_token_training_budget_is_its_direct_trace_at_five_batches(bert):
    import nblib.train  # noqa: F401  hands the training job over
    from nblib.budget.devices import device_preset

    mv = importlib.import_module("nblib.budget.model_vram")
    largest = mv.model_vram(bert, 8, train=True, inputs="tokens:64").largest_batch
    batches = sorted({1, 3, 17, max(largest // 2, 18), largest})
    replayed = mv.model_vram_table(bert, batches, train=True, inputs="tokens:64", find_largest=False)
    payload = {**mv.model_payload(bert), "precision": "fp16", "train": True, "output": None, "classes": 12,
               "cc": device_preset("t4").compute_capability, "out_dtype": mv.OUT_DTYPE, "inputs": "tokens:64",
               "record": {"input": [[64], "int64"], "target": None, "loss": "ce"}}
    assert _lines(replayed) == _lines(_direct(payload, batches))
    encode = mv.model_vram(bert, 17, inputs="tokens:64", find_largest=False)
    assert replayed[2].reserved > encode.reserved          # gradients, moments and saved activations


def test_budget_cli_trains_a_bert_on_token_ids_in_one_table(bert):
    from cli_runner import run_nblib

    done = run_nblib("budget", "--model", bert, "--input", "tokens:128", "--train", "--batch-size", "16", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    lines = {line["name"]: line["bytes"] for line in out["vram_lines"]}
    assert out["fits"] and out["largest_batch"] > 16 and lines["gradients, AdamW moments, GradScaler"] > 0


def test_train_records_on_token_ids_trains_predicts_and_its_cuda_preflight_is_the_budget(bert, token_records,
                                                                                        tmp_path, monkeypatch):
    """A BertModel on records of token ids of different lengths: trained (its mask from the padding), predicted
    with the final weights, and on a (pretended) T4 its preflight is the budget of the records' longest batch.
    """
    from cli_runner import run_nblib

    from nblib.budget.model_vram import model_vram
    from nblib.train import TrainConfig
    from nblib.train.records import RecordFields, RecordTask
    from nblib.train.task import vram_preflight

    records, longest = token_records
    run = tmp_path / "run"
    done = run_nblib("train", "--records", records, "--input-key", "ids", "--target-key", "label", "--model", bert,
                     "--output", "pooler_output", "--out", run, "--steps", "4", "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    done = run_nblib("predict", "--run", run, "--records", records, "--out", tmp_path / "pred")
    assert done.returncode == 0, done.stderr

    pf = importlib.import_module("nblib.budget.preflight")
    monkeypatch.setattr(pf, "_gpu_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(pf, "_free_vram", lambda device=None: 15 * 2**30)
    config = TrainConfig(steps=2, batch_size=8, device="cuda", precision="fp16")
    task = RecordTask(records, config, RecordFields("ids", "label"), model=bert, output="pooler_output")
    record = task.traced_record()
    assert record["input"] == [[longest], "int64"] and record["target"] == [[], "int64"]
    checked = vram_preflight(task, config)
    assert checked is not None
    assert checked.lines == model_vram(task.loaded, 8, train=True, output="pooler_output", record=record).lines
    # longer records take more: the budget follows the shards' longest record
    longer = model_vram(task.loaded, 8, train=True, output="pooler_output",
                        record={**record, "input": [[4 * longest], "int64"]}, find_largest=False)
    assert longer.reserved > checked.reserved
