"""Encoding any model: hf:CLASS and package.module:factory through the real CLI, SIGKILLed and
resumed to the same bytes; a resume with another model, config or weights refused, naming what
changed; --weights round trips; the TRM stays the default with its old fingerprint.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_nblib

from conftest import importable_models, small_cache, subprocess_env
from nblib import encode as enc
from nblib.atomic import sha256_file
from nblib.cache import ShardedImageCache
from nblib.config import preset
from nblib.errors import ConfigError, ResumeMismatch
from nblib.models import load_model
from nblib.models.weights import weights_sha256

pytest.importorskip("transformers")

N_TEXTS = 40
CONFIG = preset("smoke").replace(batch_size=2, checkpoint_every=1, consolidate_every=1)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RESNET = {"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
          "layer_type": "basic"}
FACTORY_SOURCE = '''
import os
import time

import torch
from torch import nn


class Tiny(nn.Module):
    """A conv net over 32x32 inputs (the cache's 64x64 images are resized by its preprocessing)."""

    preprocessing = {"size": [32, 32], "interpolation": "bilinear"}

    def __init__(self, width=6):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        if os.environ.get("TINY_SLOW"):
            time.sleep(0.05)          # gives the test time to kill mid-run; the bytes are the same
        fmap = torch.relu(self.conv(x))
        pooled = fmap.mean(dim=(2, 3))
        return {"features": fmap, "pooled": pooled, "logits": self.head(pooled)}


def build():
    return Tiny()


def build_wide():
    return Tiny(width=7)
'''


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """One torch thread, as the CLI subprocesses (OMP_NUM_THREADS=1): the same bytes in both."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return small_cache(tmp_path_factory.mktemp("cache") / "c", [f"#{i} any model resumes" for i in range(N_TEXTS)])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A folder with a tiny ResNet config and an importable factory module (put on PYTHONPATH)."""
    with importable_models(tmp_path_factory.mktemp("models"), RESNET, FACTORY_SOURCE) as folder:
        yield folder


def _run(cache_dir, out, model, **kwargs):
    return enc.encode(ShardedImageCache(cache_dir), out, kwargs.pop("config", CONFIG), model=model,
                      progress=False, preflight=kwargs.pop("preflight", False), **kwargs)


def _cli(cache_dir: Path, out: Path, model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nblib", "encode", "--cache", str(cache_dir), "--out", str(out),
            "--model", model, "--profile", "smoke", "--batch-size", "2", "--checkpoint-every", "1",
            "--no-progress", *extra]


def _durable_parts(out: Path) -> int:
    return len(list((out / enc.PARTS_FOLDER).glob("part-*/part.json")))


def _every_output_byte(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.npy"))}


def _kill_after(cmd: list[str], out: Path, parts: int, env: dict) -> None:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while _durable_parts(out) < parts and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read().decode()
    assert not (out / enc.INDEX_NAME).exists(), "the run finished before the kill"
    assert _durable_parts(out) >= parts


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hf:ResNetModel:{models}/resnet.json", "tinyfactory:build"])
def test_cli_encode_of_any_model_killed_and_resumed_gives_every_byte_of_an_uninterrupted_run(
        spec, cache_dir, models, tmp_path):
    spec = spec.format(models=models)
    whole = _run(cache_dir, tmp_path / "whole", spec)
    env = subprocess_env(**THREADS, TINY_SLOW="1")
    env["PYTHONPATH"] = f"{models}:{env['PYTHONPATH']}"
    killed = tmp_path / "killed"
    _kill_after(_cli(cache_dir, killed, spec), killed, 3, env)

    resumed = run_nblib(*_cli(cache_dir, killed, spec)[3:], **THREADS)       # the models are on sys.path here
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at sample" in resumed.stdout
    expected = _every_output_byte(whole.run_dir)
    assert len(expected) >= 2
    assert _every_output_byte(killed) == expected
    assert len(enc.read_index(killed)["parts"]) == N_TEXTS // 2


def test_outputs_are_the_names_the_model_returns_with_their_shapes(cache_dir, models, tmp_path):
    report = _run(cache_dir, tmp_path / "r", "tinyfactory:build", outputs=("pooled", "features"))
    assert sorted(report.outputs) == ["features", "pooled"]
    assert np.load(report.outputs["features"]).shape == (N_TEXTS, 6, 16, 16)   # resized to 32, stride 2
    assert np.load(report.outputs["pooled"]).shape == (N_TEXTS, 6)
    with pytest.raises(ConfigError, match=r"returns \['features', 'pooled', 'logits'\]"):
        _run(cache_dir, tmp_path / "bad", "tinyfactory:build", outputs=("sketches",))


def test_resume_with_another_config_class_or_preprocessing_is_refused_naming_what_changed(
        cache_dir, models, tmp_path):
    run = tmp_path / "r"
    _run(cache_dir, run, f"hf:ResNetModel:{models}/resnet.json", do_consolidate=False)
    wider = models / "wider.json"
    wider.write_text(json.dumps({**RESNET, "hidden_sizes": [8, 24]}))
    with pytest.raises(ResumeMismatch, match=r"config\.hidden_sizes: \[8, 16\] -> \[8, 24\]"):
        _run(cache_dir, run, f"hf:ResNetModel:{wider}")
    with pytest.raises(ResumeMismatch, match=r"class: transformers\.models\.resnet.*ResNetModel -> tinyfactory\.Tiny"):
        _run(cache_dir, run, "tinyfactory:build")
    with pytest.raises(ResumeMismatch, match=r"model changed \(hf:ResNetModel.* -> the TRM \(trm\)\)"):
        _run(cache_dir, run, None)
    factory_run = tmp_path / "f"
    _run(cache_dir, factory_run, "tinyfactory:build", do_consolidate=False)
    with pytest.raises(ResumeMismatch, match=r"config|weights: sha256"):
        _run(cache_dir, factory_run, "tinyfactory:build_wide")


@pytest.mark.slow
def test_cli_refusal_of_another_model_is_one_error_line_exit_2(cache_dir, models, tmp_path):
    run = tmp_path / "r"
    _run(cache_dir, run, None, do_consolidate=False)          # the TRM, the default
    second = run_nblib(*_cli(cache_dir, run, "tinyfactory:build")[3:], **THREADS)
    assert second.returncode == 2, second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model changed (the TRM (trm) -> tinyfactory:build)" in errors[0], second.stderr
    assert "Traceback" not in second.stderr


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_weights_round_trip_same_bytes_and_other_weights_are_refused_on_resume(
        suffix, cache_dir, models, tmp_path):
    import torch

    from nblib.models import load_model, save_weights

    seeded = load_model("tinyfactory:build", seed=CONFIG.run.seed)
    same = save_weights(seeded.module, tmp_path / f"same{suffix}")
    plain = _run(cache_dir, tmp_path / "plain", "tinyfactory:build")
    loaded = _run(cache_dir, tmp_path / "loaded", "tinyfactory:build", weights=same)
    assert _every_output_byte(loaded.run_dir) == _every_output_byte(plain.run_dir)

    with torch.no_grad():
        seeded.module.head.bias.add_(1.0)
    other = save_weights(seeded.module, tmp_path / f"other{suffix}")
    changed = _run(cache_dir, tmp_path / "changed", "tinyfactory:build", weights=other)
    assert sha256_file(changed.outputs["logits"]) != sha256_file(plain.outputs["logits"])
    assert sha256_file(changed.outputs["pooled"]) == sha256_file(plain.outputs["pooled"])   # only the head moved
    with pytest.raises(ResumeMismatch, match=r"weights: sha256"):
        _run(cache_dir, tmp_path / "plain", "tinyfactory:build", weights=other)


def test_the_trm_is_the_default_spec_with_its_old_fingerprints_and_bytes(cache_dir, tmp_path):
    default = _run(cache_dir, tmp_path / "default", None)
    named = _run(cache_dir, tmp_path / "named", "trm")
    assert _every_output_byte(named.run_dir) == _every_output_byte(default.run_dir)
    fingerprints = enc.read_index(default.run_dir)["fingerprints"]
    assert set(fingerprints) >= {"settings", "weights", "cache"} and "model" not in fingerprints
    assert fingerprints["weights"] == weights_sha256(load_model("trm", config=CONFIG).module, typed=False)


def test_preflight_checks_the_disks_from_the_models_own_output_shapes(cache_dir, models, tmp_path):
    from nblib.encode.disks import disk_needs
    from nblib.encode.model import encode_model

    model = encode_model(CONFIG, "tinyfactory:build")
    assert model.bytes_per_sample("float16") == (6 * 16 * 16 + 6 + 5) * 2
    plan = enc.plan_run(CONFIG, N_TEXTS)
    needs = disk_needs(CONFIG, tmp_path, None, plan, list(range(plan.n_parts)), per_image=model.bytes_per_sample(
        "float16"), n_outputs=3)
    assert needs["consolidated outputs"][1] == N_TEXTS * model.bytes_per_sample("float16") + 4 * 4096
    report = _run(cache_dir, tmp_path / "r", "tinyfactory:build", preflight=True)   # runs, no TRM lines
    assert report.parts_encoded == N_TEXTS // 2
