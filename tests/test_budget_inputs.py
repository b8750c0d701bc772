"""Inputs other than images (issue 49): `budget --model hf:BertModel:... --input tokens:LENGTH` traces the encode loop
with int64 input_ids and attention_mask of [B, LENGTH], no wrapper; a budget that cannot be made says so in one line.
"""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert(traced_bert) -> str:
    return traced_bert


def test_budget_of_a_bert_style_encoder_on_token_ids_and_a_mask(bert):
    """It exited with `too many values to unpack` (the budget fed every model images); now it budgets from a trace
    of BertModel called with input_ids and attention_mask, and searches its largest batch.
    """
    from cli_runner import run_nblib

    done = run_nblib("budget", "--model", bert, "--input", "tokens:128", "--batch-size", "16", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["fits"] and out["largest_batch"] > 16
    lines = {line["name"]: line["bytes"] for line in out["vram_lines"]}
    assert lines["input batch and activations at the peak"] >= 2 * 16 * 128 * 8      # input_ids and the mask


def test_the_token_budget_is_its_direct_trace_and_grows_with_the_length(bert):
    from importlib import import_module

    from nblib.budget.devices import device_preset

    mv = import_module("nblib.budget.model_vram")
    batches = (1, 7, 40)
    replayed = mv.model_vram_table(bert, batches, inputs="tokens:64", find_largest=False)
    payload = {**mv.model_payload(bert), "precision": "fp16", "train": False, "output": None, "classes": 12,
               "cc": device_preset("t4").compute_capability, "out_dtype": mv.OUT_DTYPE, "inputs": "tokens:64",
               "batches": list(batches), "cap": mv.reserved_cap("t4"), "search": False, "max_batch": 40,
               "replay": False}
    points = mv.trace_child(payload)["points"]
    direct = [mv._budget(payload, device_preset("t4"), b, p, None) for b, p in zip(batches, points)]
    assert [[(ln.name, ln.bytes) for ln in v.lines] for v in replayed] == \
        [[(ln.name, ln.bytes) for ln in v.lines] for v in direct]
    longer = mv.model_vram(bert, 40, inputs="tokens:256", find_largest=False)
    activations = "input batch and activations at the peak"
    assert longer.line(activations) > replayed[-1].line(activations)


def test_what_the_budget_cannot_make_is_one_line(bert):
    from cli_runner import run_nblib

    for args, says in ((("--model", bert, "--input", "words:64"), "write images (the default) or tokens:LENGTH"),
                       (("--model", "hf:ViTModel", "--input", "tokens:64"), "token inputs are for text encoders")):
        done = run_nblib("budget", *args, "--batch-size", "8")
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        error = done.stderr.strip().splitlines()
        assert len(error) == 1 and says in error[0], done.stderr
