"""A budget never extrapolates a line it has not checked (issue 49): three traced batches, or each batch traced.

The line through two traces is kept only where a third is on it to the byte (nblib.budget.allocator.affine_stream);
a model with an in-batch [B, B] tensor, or one whose forward branches on the batch size, is traced at every batch
it is asked for and at every probe of the largest-batch search, and its budget equals a direct trace.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import traceable_models

MODELS = '''
import torch
from torch import nn


class Pairwise(nn.Module):
    """Pairwise distances in the batch: [B, B, 256] differences, a [B, B] weighting (a contrastive head)."""

    preprocessing = {"size": [16, 16], "interpolation": "bilinear"}

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3 * 16 * 16, 256)

    def forward(self, x):
        emb = self.embed(x.flatten(1))
        dist = (emb[:, None] - emb[None]).pow(2).sum(-1)
        return {"pooled": (-dist).softmax(-1) @ emb}


class Branchy(nn.Module):
    """A forward that takes another path from batch 32 on (as a chunked or fused kernel switch would): a line
    through batches 2, 3 and 16 would not have seen it.
    """

    preprocessing = {"size": [16, 16], "interpolation": "bilinear"}

    def __init__(self):
        super().__init__()
        self.narrow = nn.Linear(3 * 16 * 16, 16)
        self.wide = nn.Linear(3 * 16 * 16, 512)
        self.out = nn.Linear(512, 16)

    def forward(self, x):
        flat = x.flatten(1)
        if x.shape[0] >= 32:
            return {"pooled": self.out(torch.relu(self.wide(flat)))}
        return {"pooled": self.narrow(flat)}
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with traceable_models(tmp_path_factory, MODELS) as folder:
        yield folder


@pytest.fixture
def on_path(models, monkeypatch):
    """The models' folder on the traces' PYTHONPATH (a child imports the factory module)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(models), os.environ.get("PYTHONPATH")) if p))
    return models


def test_a_line_is_kept_only_where_a_third_trace_is_on_it_to_the_byte():
    """A [B, B] fp32 tensor (4 B^2 bytes) is a line through batches 2 and 3 (16, 36 bytes: 20 per sample), and the
    old two-trace line said 336 bytes at batch 16 where the trace holds 1024: the third trace refuses the line.
    """
    from nblib.budget.allocator import affine_stream, events_at

    def events(b: int, square: bool) -> list:
        return [("m", 1, 4096), ("m", 2, 4 * b * (b if square else 7)), ("f", 2), ("k", "resident")]

    assert affine_stream({b: events(b, True) for b in (2, 3, 16)}) is None
    line = affine_stream({b: events(b, False) for b in (2, 3, 16)})
    assert events_at(line, 100) == [tuple(e) for e in events(100, False)]


def test_a_replay_whose_line_gives_a_negative_size_traces_that_batch_instead():
    """(B - 2) KiB is one line through 3, 4 and 16 (a size from batch 3 on), and -1 KiB at batch 1: that batch is
    traced, and the largest-batch search (which starts at 1) answers, where it died in replay_stats (TypeError).
    """
    from importlib import import_module

    from nblib.budget.allocator import affine_stream

    mv = import_module("nblib.budget.model_vram")
    line = affine_stream({b: [("m", 1, 1024 * (b - 2) or 512), ("k", "weights"), ("k", "resident")]
                          for b in (3, 4, 16)})
    traced = []
    point = {"weights": 0, "resident": 0, "workspace": 0, "max_allocated": 512, "reserved_pytorch": 2 << 20,
             "reserved": {"after the first GEMM's output": 2 << 20}, "peak_op": "traced"}
    stream = mv._Stream(line, "replayed", (), trace=lambda b: traced.append(b) or point)
    assert stream.point(1)["peak_op"] == "traced" and traced == [1]
    assert stream.point(40)["peak_op"] == "replayed"
    assert mv.largest_batch(stream.point, 1 << 30, 64) == 64 and traced == [1]


def _direct(mv, spec: str, batches, train: bool) -> list:
    """Each batch traced by the child itself (no line, no replay): the budget a direct trace gives."""
    from nblib.budget.devices import device_preset

    payload = {**mv.model_payload(spec), "precision": "fp16", "train": train, "output": None, "classes": 12,
               "cc": device_preset("t4").compute_capability, "out_dtype": mv.OUT_DTYPE, "batches": list(batches),
               "cap": mv.reserved_cap("t4"), "search": False, "max_batch": max(batches), "replay": False}
    points = mv.trace_child(payload)["points"]
    return [mv._budget(payload, device_preset("t4"), b, p, None) for b, p in zip(batches, points)]


def _bytes(v) -> tuple:
    return [(ln.name, ln.bytes) for ln in v.lines], v.reserved_by_position


@pytest.mark.parametrize("name,train", [("Pairwise", False), ("Pairwise", True), ("Branchy", False),
                                        ("Branchy", True)])
def test_a_model_that_is_not_one_line_is_budgeted_as_its_direct_trace_from_batch_1_to_its_largest(on_path, name,
                                                                                                  train):
    """Five batches from 1 to the largest the search finds (each probe traced): the budget is the direct trace's,
    line for line, at every workspace position.
    """
    from importlib import import_module

    mv = import_module("nblib.budget.model_vram")
    spec = f"tinyfactory:{name}"
    largest = mv.model_vram(spec, 1, train=train).largest_batch
    batches = (1, 5, 24, 200, largest)
    budgets = mv.model_vram_table(spec, batches, train=train, find_largest=False)
    direct = _direct(mv, spec, batches, train)
    assert [_bytes(v) for v in budgets] == [_bytes(v) for v in direct]
    assert budgets[-1].fits and largest > 200


def test_the_largest_batch_search_of_a_pairwise_model_answers_in_one_line(on_path):
    """`budget --model ... --batch-size 1024` of a [B, B] model exited 1 with a 46-line TypeError; its largest
    batch is now searched by traces, and the batch it names fits where the next one does not.
    """
    from cli_runner import run_nblib

    from nblib.budget.model_vram import model_vram_table

    done = run_nblib("budget", "--model", "tinyfactory:Pairwise", "--batch-size", "1024", "--json")
    assert "Traceback" not in done.stderr and done.returncode in (0, 2), done.stderr
    largest = json.loads(done.stdout)["largest_batch"]
    assert largest >= 1024
    at, above = model_vram_table("tinyfactory:Pairwise", (largest, largest + 1), find_largest=False)
    assert at.fits and (largest == 4096 or not above.fits)
