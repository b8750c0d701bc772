"""What only a GPU can show about training, run as they are on a GPU machine (a Colab T4):

    python -m pytest -m gpu tests/test_train_gpu.py -v

Each test skips, with the reason, where torch sees no CUDA device (the project's CI has none). They
run the real command line: `python -m nblib train` with no --device trains on cuda; a run SIGKILLed
after a checkpoint and rerun ends with the uninterrupted run's final weights, byte for byte (strict
deterministic kernels, cuBLAS's workspace); an asynchronous save writes the same bytes as a synchronous
one; the largest-batch probe caps the GPU with set_per_process_memory_fraction and reports
max_memory_reserved apart from the host's RSS; the process's determinism switches are its own again
after `train`, so a later CUDA cell runs; two GPUs train over nccl and resume exactly.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import assert_same_weights, labelled_cache, weights_of
from train_runs import ARGS, newest_step, run_and_kill, train_cli, train_env

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("gpu"), 160)


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> Path:
    """One uninterrupted run on the GPU, with no --device: the default must be cuda."""
    out = tmp_path_factory.mktemp("gpu-ref") / "run"
    _ok(subprocess.run(train_cli(cache_dir, out), env=train_env(), capture_output=True, text=True, timeout=900))
    return out


def test_train_runs_on_cuda_when_no_device_is_named(reference):
    from nblib.manifest import read_manifest
    from nblib.train.loop import REPORT, REPORT_KIND

    body = read_manifest(reference / REPORT, REPORT_KIND).body
    assert body["config"]["device"] == "cuda"
    state = torch.load(sorted((reference / "checkpoints").glob("state-*.pt"))[-1], weights_only=True,
                       map_location="cpu")
    assert "cuda" not in state["rng"]                        # re-seeded every step: a state resumes on any GPU count
    history = body["history"]
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sigkill_then_rerun_on_cuda_gives_the_uninterrupted_weights_bit_for_bit(cache_dir, tmp_path, precision):
    extra = ("--device", "cuda", "--precision", precision)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _ok(subprocess.run(train_cli(cache_dir, whole, *extra), env=train_env(), capture_output=True, text=True,
                       timeout=900))
    run_and_kill(train_cli(cache_dir, killed, *extra), killed, after_step=4, extra_s=0.05)
    assert not (killed / "final.pt").exists() and newest_step(killed) >= 4
    done = _ok(subprocess.run(train_cli(cache_dir, killed, *extra), env=train_env(), capture_output=True,
                              text=True, timeout=900))
    assert "resumed from local" in done.stdout
    assert_same_weights(weights_of(killed), weights_of(whole))


def test_an_asynchronous_save_writes_the_bytes_of_a_synchronous_one(cache_dir, tmp_path):
    runs = {}
    for name, extra in (("sync", ("--sync-save",)), ("async", ())):
        out = tmp_path / name
        _ok(subprocess.run(train_cli(cache_dir, out, "--device", "cuda", *extra), env=train_env(),
                           capture_output=True, text=True, timeout=900))
        runs[name] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in (out / "checkpoints").glob("state-*.pt")}
    assert runs["sync"] and runs["sync"] == runs["async"]


def test_the_largest_batch_probe_caps_the_gpu_and_reports_its_reservation_apart_from_host_ram():
    from nblib.config import for_profile
    from nblib.train.probe import step_peak

    model = for_profile("smoke").model
    small = step_peak(model, 8, device="cuda", precision="fp16")
    assert small.fits and small.device_peak > 0, small.error
    assert small.peak_rss - small.rss_before < small.device_peak + 512 * 2**20   # host RSS holds no device bytes
    cap = max(small.device_peak * 2, 64 * 2**20)
    inside = step_peak(model, 8, device="cuda", precision="fp16", cap_bytes=cap)
    assert inside.fits and inside.device_peak <= cap, inside
    over = step_peak(model, 4096, device="cuda", precision="fp16", cap_bytes=cap)
    assert not over.fits and "out of memory" in over.error.lower(), over
    assert over.device_peak <= cap


def test_train_gives_a_later_cuda_cell_its_switches_back(cache_dir, tmp_path):
    from nblib.train import TrainConfig, train

    torch.use_deterministic_algorithms(False)
    config = TrainConfig(steps=2, batch_size=16, save_every=2, backup_every=2, eval_every=2, warmup_steps=1,
                         device="cuda")
    train(cache_dir, tmp_path / "run", config)
    assert not torch.are_deterministic_algorithms_enabled()
    x = torch.randn(64, 64, device="cuda")
    assert torch.isfinite(x @ x).all()                       # cuBLAS after train, in the same process


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_train_over_nccl_and_a_killed_launch_resumes_exactly(cache_dir, tmp_path):
    def launch(out: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--max-restarts", "0", "-m", "nblib", "train", "--cache", str(cache_dir), "--out", str(out), *ARGS,
                "--steps", "16", "--device", "cuda"]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _ok(subprocess.run(launch(whole), env=train_env(), capture_output=True, text=True, timeout=900))
    run_and_kill(launch(killed), killed, after_step=4, extra_s=0.05, group=True)
    _ok(subprocess.run(launch(killed), env=train_env(), capture_output=True, text=True, timeout=900))
    assert_same_weights(weights_of(killed), weights_of(whole))


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done
