"""cuDNN's RNNs are refused by the budget in one line naming the module, never budgeted wrong nor a traceback.

The trace does not model cuDNN's RNN (its flattened weight buffer, workspace and training reserve; a CPU build of
torch runs its own cell loop instead), so an LSTM was budgeted 1.60x off in fp32, and a GRU's trace died (its CUDA
cell has no fake kernel). `budget --model` of either, fp32 or fp16, encoding or training, is one `error:` line
that names the module and where it sits (issue 49).
"""
from __future__ import annotations

import os

import pytest

from conftest import traceable_models

MODELS = '''
from torch import nn


class Seq(nn.Module):
    """The image's rows as a sequence through a recurrent layer, its outputs averaged."""

    preprocessing = {"size": [16, 16], "interpolation": "bilinear"}
    kind = nn.LSTM

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"rnn": self.kind(48, 32, batch_first=True)})

    def forward(self, x):
        out, _ = self.layers["rnn"](x.permute(0, 2, 3, 1).flatten(2))
        return {"pooled": out.mean(1)}


class SeqGRU(Seq):
    kind = nn.GRU
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with traceable_models(tmp_path_factory, MODELS) as folder:
        yield folder


@pytest.mark.parametrize("name,kind", [("Seq", "LSTM"), ("SeqGRU", "GRU")])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("train", [False, True])
def test_an_rnn_is_refused_in_one_line_naming_it(models, name, kind, precision, train):
    from cli_runner import run_nblib

    path = os.pathsep.join(p for p in (str(models), os.environ.get("PYTHONPATH")) if p)
    done = run_nblib("budget", "--model", f"tinyfactory:{name}", "--batch-size", "8", "--precision", precision,
                     *(["--train"] if train else []), PYTHONPATH=path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: nn.{kind} at layers.rnn: cuDNN's RNN"), lines


def test_refuse_unmodelled_names_each_kind_and_passes_the_rest():
    from torch import nn

    from nblib.budget.trace import refuse_unmodelled
    from nblib.errors import NotModelled

    refuse_unmodelled(nn.Sequential(nn.LSTMCell(4, 4), nn.RNNCell(4, 4), nn.Linear(4, 4)))   # traced as they run
    for module, words in ((nn.RNN(4, 4), "nn.RNN at the model itself"),
                          (nn.Sequential(nn.Linear(4, 4), nn.GRUCell(4, 4)), "nn.GRUCell at 1: its CUDA kernel")):
        with pytest.raises(NotModelled, match=words):
            refuse_unmodelled(module)
