"""A `--model` trace kept in the user's trace cache (nblib.budget.model_vram.kept_trace, nblib.budget.trace_store):
a second identical budget in a new process reads it and starts no child; whatever could change the answer (the
config file, the factory's source, the precision) traces again; a damaged entry is named and traced again.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

from conftest import hf_spec, subprocess_env

REPO = Path(__file__).resolve().parents[1]
POINT = {"weights": 1, "resident": 1, "workspace": 0, "max_allocated": 2, "reserved_pytorch": 2 << 20,
         "reserved": {"after the first GEMM's output": 2 << 20}, "peak_op": "aten.mm"}


@pytest.fixture
def counted_child(monkeypatch, tmp_path):
    """A fresh user folder, no job kept in this process, and a child that answers points at once and counts."""
    mv = import_module("nblib.budget.model_vram")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(mv, "_STREAMS", {})
    asked = []

    def child(job, payload, timeout_s=600.0):
        asked.append((payload["spec"], payload["precision"]))
        return {"stream": None, "points": [POINT for _ in payload["batches"]], "nondeterministic": [], "largest": 7}

    monkeypatch.setattr(mv, "run_job", child)
    return mv, asked


def _kept(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "xdg" / "nblib" / "traces").glob("model-*.json"))


def test_an_edited_config_or_another_precision_is_traced_again(counted_child, tmp_path):
    mv, asked = counted_child
    config = tmp_path / "vit.json"
    config.write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    spec = f"hf:ViTModel:{config}"
    first = mv.model_vram(spec, 3)
    assert mv.model_vram(spec, 3).as_json() == first.as_json() and len(asked) == 1 and len(_kept(tmp_path)) == 1
    mv.model_vram(spec, 3, precision="fp32")
    assert asked[-1] == (spec, "fp32") and len(asked) == 2
    mv.model_vram(spec, 4)                                          # another batch of a job that is not affine
    assert len(asked) == 3
    config.write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    mv.model_vram(spec, 3)
    assert len(asked) == 4
    mv.model_vram(spec, 3)
    assert len(asked) == 4 and len(_kept(tmp_path)) == 4


def test_an_edited_factory_is_traced_again_and_one_without_a_source_file_every_time(counted_child, tmp_path,
                                                                                      monkeypatch):
    mv, asked = counted_child
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    factory = tmp_path / "mine" / "nets.py"
    factory.write_text("def build():\n    return None\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mv.model_vram("mine.nets:build", 3)
    mv.model_vram("mine.nets:build", 3)
    assert len(asked) == 1
    factory.write_text("def build():\n    return 'another model'\n")
    mv.model_vram("mine.nets:build", 3)
    assert len(asked) == 2
    factory.unlink()
    (tmp_path / "mine" / "nets.cpython-311.so").write_bytes(b"")   # a compiled module: no source to key it by
    assert mv.model_source("mine.nets:build") is None
    for _ in range(2):
        mv.model_vram("mine.nets:build", 3)
    assert len(asked) == 4 and mv.model_source("math:sqrt") is None


@pytest.mark.parametrize("damage", ["a flipped byte", "cut short", "another job's entry"])
def test_a_damaged_entry_is_named_in_one_line_and_traced_again(counted_child, tmp_path, caplog, damage):
    mv, asked = counted_child
    spec = "hf:ViTModel"
    mv.model_vram(spec, 3)
    mv.model_vram(spec, 5)
    (path, other) = sorted(_kept(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    text = path.read_text()
    if damage == "a flipped byte":
        text = text.replace('"largest": 7', '"largest": 9')
    elif damage == "cut short":
        text = text[: len(text) // 2]
    else:
        text = other.read_text()
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="nblib.budget"):
        again = mv.model_vram(spec, 3)
    lines = [r.getMessage() for r in caplog.records if "kept trace" in r.getMessage()]
    assert len(asked) == 3 and again.largest_batch == 7
    assert len(lines) == 1 and "\n" not in lines[0] and str(path) in lines[0] and "traced again" in lines[0]
    mv.model_vram(spec, 3)                                          # written again, whole: read, no child
    assert len(asked) == 3


def test_the_entries_used_last_are_kept_and_older_ones_go(counted_child, tmp_path, monkeypatch):
    import os

    from nblib.budget import trace_store

    mv, asked = counted_child
    monkeypatch.setattr(trace_store, "KEPT_RESULTS", 2)
    for b in (3, 4):
        mv.model_vram("hf:ViTModel", b)
    for i, path in enumerate(sorted(_kept(tmp_path), key=lambda p: p.stat().st_mtime_ns)):
        os.utime(path, ns=(i * 10**9, i * 10**9))                  # 3's entry older than 4's
    mv.model_vram("hf:ViTModel", 3)                                 # read: touched, now the newest
    mv.model_vram("hf:ViTModel", 5)                                 # a third entry: 4's, used least lately, goes
    assert len(asked) == 3 and len(_kept(tmp_path)) == 2
    mv.model_vram("hf:ViTModel", 3)
    mv.model_vram("hf:ViTModel", 4)
    assert len(asked) == 4


SECOND_RUN = """
import json, sys
from nblib import encode, train  # the jobs hand themselves over, as the CLI's budget does
mv = sys.modules["nblib.budget.model_vram"]
if sys.argv[3:] == ["searched"]:
    def no_search(*args):
        raise AssertionError("the largest batch was searched again")
    mv.largest_batch = no_search
print(json.dumps(mv.model_vram(sys.argv[1], 8, train=sys.argv[2] == "train").as_json()))
"""


@pytest.mark.parametrize("train", [False, True], ids=["encode", "train"])
def test_a_second_budget_in_a_new_process_reads_the_kept_trace_and_starts_no_child(tmp_path, train):
    """The first process traces (the shim compiled, a child run); the shim is then removed and cannot be compiled
    (CXX=/bin/false), so a second process answers only if it starts no child: it answers, the same to the byte,
    and without searching the largest batch again (kept with the trace).
    """
    spec = hf_spec(tmp_path / "vit.json", "ViTModel", traced=True, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8)
    args = [sys.executable, "-c", SECOND_RUN, spec, "train" if train else "encode"]
    xdg = tmp_path / "xdg"

    def run(*more, **extra):
        env = subprocess_env(XDG_CACHE_HOME=str(xdg), NBLIB_WARM_TRACES="0", **extra)
        done = subprocess.run([*args, *more], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    first = run()
    assert first["largest_batch"] > 8 and len(list((xdg / "nblib" / "traces").glob("model-*.json"))) == 1
    shutil.rmtree(xdg / "nblib" / "shim")
    assert run("searched", CXX="/bin/false") == first
