"""The determinism check fails closed (nblib.train.determinism): torch's list from its docstring, else nblib's copy.

Under `python -OO` torch's docstrings are gone, and a reworded docstring parses to few entries: the check found 0
ops and said nothing. It now warns, naming torch's version, and uses the copy shipped as data
(nblib.train.determinism_table), which is compared here with the installed torch's docstring.
"""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from nblib.train import determinism  # noqa: E402
from nblib.train.determinism_table import DOCUMENTED  # noqa: E402

# a traced step's kernels: AdaptiveAvgPool2d's backward (to 2x2) and a bilinear interpolate's backward
KERNELS = [("_adaptive_avg_pool2d_backward.default", "float32"), ("upsample_bilinear2d_backward.vec", "float32")]


def test_the_shipped_copy_is_the_installed_torchs_docstring():
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    read = determinism.read_docstring(torch.use_deterministic_algorithms.__doc__)
    assert len(read) >= 20, "torch's docstring no longer parses: fix determinism.SECTION/BULLET"
    rows = "\n".join(f"        {row!r}," for row in read)
    assert DOCUMENTED.get(release) == read, f"add torch {release}'s rows to nblib/train/determinism_table.py:\n{rows}"


def test_a_reworded_docstring_falls_back_to_the_copy_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.use_deterministic_algorithms, "__doc__", "Sets whether PyTorch operations must use "
                        "deterministic algorithms. (The list moved to the notes on reproducibility.)")
    determinism._table.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nblib.train"):
            found = determinism.documented_in(KERNELS)
    finally:
        determinism._table.cache_clear()
    assert {f["name"] for f in found} == {"torch.nn.AdaptiveAvgPool2d", "torch.nn.functional.interpolate"}
    assert any(torch.__version__ in r.getMessage() and "gave 0 of the" in r.getMessage() for r in caplog.records)


def test_under_python_OO_the_check_still_refuses_the_ops_it_should():
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "assert torch.use_deterministic_algorithms.__doc__ is None\n"
        "from nblib.errors import DeterminismError\n"
        "from nblib.train.determinism import check_traced, documented_in\n"
        f"found = documented_in({KERNELS!r})\n"
        "try:\n"
        "    check_traced(found, 'pool-model', 'cuda:0')\n"
        "except DeterminismError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1 and "torch.nn.AdaptiveAvgPool2d" in refused[0], done.stdout
    assert "torch.nn.functional.interpolate" in refused[0] and "--nondeterministic" in refused[0]
    assert f"torch {torch.__version__}: its use_deterministic_algorithms docstring gave 0" in done.stderr
