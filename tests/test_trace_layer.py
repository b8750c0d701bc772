"""One trace layer (issue 50): the jobs hand their traced jobs to it, the budget asks for the job of its kind.

nblib.budget.traced_jobs runs a job it is handed (a top-level function) in the shim's child by the reference read
from the function; nblib.encode and nblib.train hand theirs over when imported, and the composition roots (the CLI,
the notebooks' lab, the widgets) import them. The budget itself names neither (tests/test_import_graph.py).
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("train,package", [(False, "nblib.encode"), (True, "nblib.train")])
def test_a_budget_in_a_process_no_job_was_handed_to_is_refused_in_one_line_naming_the_import(train, package):
    done = _python("import sys\nfrom nblib.budget.model_vram import model_vram\nfrom nblib.errors import one_line\n"
                   f"try:\n    model_vram('hf:AnyModel:none', 3, train={train})\n"
                   "except Exception as exc:\n    print(type(exc).__name__, one_line(exc))\n"
                   "print('torch' in sys.modules)")
    assert done.returncode == 0, done.stderr
    refusal, torch_loaded = done.stdout.strip().splitlines()
    assert refusal.startswith("ConfigError ") and f"import {package} " in refusal, refusal
    assert torch_loaded == "False"                       # refused before any child or trace


@pytest.mark.parametrize("root", ["import nblib.lab", "import nblib.widgets",
                                  "import nblib.cli, contextlib\nwith contextlib.suppress(SystemExit):\n"
                                  "    nblib.cli.main(['budget', '--help'])",
                                  "import nblib.lab.training", "import nblib.lab.your_model"])
def test_every_composition_root_hands_its_jobs_over_and_only_training_sets_the_cublas_config(root):
    """The roots hand the encode job over; the training job only where training is budgeted (importing nblib.train
    sets CUBLAS_WORKSPACE_CONFIG, which an encode budget and an encode run read: 8.1 MiB of workspace became 32 MiB
    in `budget --model trm:smoke` when the CLI imported it for every verb).
    """
    if "widgets" in root:
        pytest.importorskip("ipywidgets")
    code = (f"import json, os\nos.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)\n{root}\n"
            "from nblib.budget import traced_jobs\n"
            "print(json.dumps({k: f.__module__ for k, f in traced_jobs._JOBS.items()}))\n"
            "print('CUBLAS_WORKSPACE_CONFIG' in os.environ)")
    done = _python(code)
    assert done.returncode == 0, done.stderr
    jobs, cublas_set = done.stdout.strip().splitlines()[-2:]
    trains = "training" in root or "your_model" in root
    assert json.loads(jobs) == {"encode": "nblib.encode.traced", **({"train": "nblib.train.traced"} if trains else {})}
    assert cublas_set == str(trains)


def test_the_child_is_given_the_job_by_the_reference_read_from_the_function(monkeypatch):
    """What reaches the child names the handed-over function (no module named in the budget's source), and the
    child's runner resolves it back to the same function.
    """
    from nblib.budget import traced_jobs
    from nblib.encode.traced import trace_encoding

    sent = {}
    monkeypatch.setattr(traced_jobs, "run_child", lambda module, payload, timeout_s: sent.update(
        module=module, payload=payload) or {"ok": True})
    assert traced_jobs.run_job(traced_jobs.job_for("encode"), {"spec": "x"}) == {"ok": True}
    assert sent["module"] == traced_jobs.__name__ and sent["payload"]["job"] == ["nblib.encode.traced",
                                                                                  "trace_encoding"]
    assert traced_jobs.job_for("encode") is trace_encoding
    with pytest.raises(Exception, match="no other job was handed"):
        traced_jobs.job_for("other")


def test_a_records_run_of_the_builtin_linear_model_on_cuda_says_in_one_line_that_its_vram_is_not_checked(caplog):
    """Issue 49: a --records run is budgeted from its records' step (tests/test_budget_record_training.py), but the
    built-in linear model has no spec the trace can rebuild: it says so in one line (never a traceback or silence).
    """
    from types import SimpleNamespace

    from nblib.train.config import TrainConfig
    from nblib.train.task import vram_preflight

    records = SimpleNamespace(flag="--records", loaded=SimpleNamespace(kind="builtin"))
    with caplog.at_level(logging.WARNING, logger="nblib.train.task"):
        assert vram_preflight(records, TrainConfig(device="cuda:0")) is None
        assert vram_preflight(records, TrainConfig(device="cpu")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "linear model is not checked" in lines[0]
    assert "--model package.module:factory" in lines[0] and "\n" not in lines[0]
