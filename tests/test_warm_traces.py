"""The warm fake-CUDA process (nblib.budget.warm): a fork per trace, clean state each time, same results."""
from __future__ import annotations

import subprocess
import textwrap

import pytest

from nblib.budget.warm import WarmProcess

PROBE = textwrap.dedent('''
    import os
    import time

    import torch

    def _child(payload):
        if payload.get("fail"):
            raise ValueError("the probe failed on purpose")
        if payload.get("sleep"):
            time.sleep(payload["sleep"])
        seen = getattr(torch, "_nblib_probe_mark", None)
        torch._nblib_probe_mark = payload["mark"]          # global torch state, changed in the fork only
        print("a print must not reach the protocol pipe")
        return {"seen": seen, "pid": os.getpid(), "cwd": os.getcwd()}
''')


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    import os

    folder = tmp_path_factory.mktemp("probe")
    (folder / "nblib_warm_probe.py").write_text(PROBE)
    before = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{folder}{os.pathsep}{before}"
    try:
        server = WarmProcess(None)
    finally:
        os.environ["PYTHONPATH"] = before
    yield server
    server.close()


def test_each_request_runs_in_its_own_fork_from_a_clean_state(warm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = warm.run("nblib_warm_probe", {"mark": 1}, 60)
    second = warm.run("nblib_warm_probe", {"mark": 2}, 60)
    assert first["seen"] is None and second["seen"] is None      # the first fork's change did not survive it
    assert first["pid"] != second["pid"] and first["cwd"] == second["cwd"] == str(tmp_path)


def test_a_failing_trace_reports_its_last_error_line_and_the_process_stays_warm(warm):
    with pytest.raises(RuntimeError, match="ValueError: the probe failed on purpose"):
        warm.run("nblib_warm_probe", {"mark": 3, "fail": True}, 60)
    assert warm.alive and warm.run("nblib_warm_probe", {"mark": 4}, 60)["seen"] is None


def test_a_trace_past_its_time_limit_is_killed_and_a_new_warm_process_starts(tmp_path_factory, warm):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run("nblib_warm_probe", {"mark": 5, "sleep": 30}, 1.0)
    assert not warm.alive                     # closed: the next request through run_warm starts a fresh one


@pytest.mark.slow
def test_a_warm_budget_equals_a_fresh_process_budget(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from nblib.budget.model_vram import model_vram
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    config = tmp_path / "vit.json"
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8).to_json_file(config)
    spec = f"hf:ViTModel:{config}"
    monkeypatch.setenv("NBLIB_WARM_TRACES", "1")
    warm = model_vram(spec, 8, precision="fp16", train=True, find_largest=False)
    monkeypatch.setenv("NBLIB_WARM_TRACES", "0")
    fresh = model_vram(spec, 8, precision="fp16", train=True, find_largest=False)
    assert warm == fresh
