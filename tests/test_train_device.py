"""The GPU items of training, shown on a CPU wherever a CPU can show them: the default device, device
flags refused in one line, strict determinism restored when `train` returns or raises, cuBLAS's
workspace set before CUDA starts, an op with no deterministic kernel named, a skipped GradScaler
step that leaves the LR schedule alone, a diverged run stopped before it saves, backward outside
autocast, pinned batches, loader workers that never fork a live thread, the nccl group of DDP on
GPUs, and per-rank dropout seeds (two real torchrun ranks killed and resumed: tests/test_train_resume.py).
(tests/test_train_gpu.py runs what only a GPU can show.)
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from cli_runner import run_nblib

from conftest import subprocess_env
from nblib.errors import ConfigError, DeterminismError, TrainingDiverged
from nblib.train import TrainConfig, train
from nblib.train import device as devices

TINY = TrainConfig(steps=4, batch_size=16, save_every=2, backup_every=2, eval_every=2, warmup_steps=1, device="cpu")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    from test_train import labelled_cache

    return labelled_cache(tmp_path_factory.mktemp("device"), 80)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread, as the CLI subprocesses run."""


# ------------------------------------------------------------------------------ the device


def test_the_default_device_is_cuda_when_a_gpu_is_present_as_encode_picks(monkeypatch):
    from nblib import env
    from nblib.cli.train import _train_args

    monkeypatch.setattr(env, "cuda_available", lambda: True)
    assert TrainConfig().device == "cuda"
    assert TrainConfig(device="cpu").device == "cpu"
    monkeypatch.setattr(env, "cuda_available", lambda: False)
    assert TrainConfig().device == "cpu"
    args = _train_args(["--cache", "c", "--out", "o", "--steps", "2"])
    assert args.device == "cpu"
    assert TrainConfig(device=args.device).device == "cpu"


@pytest.mark.parametrize("flag", ["cuda", "cuda:5", "meta", "gpu", "cuda:x", "mps"])
def test_a_device_this_machine_lacks_is_one_error_line_and_exit_2(flag, tmp_path):
    if flag.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda is a device it has")
    done = run_nblib("train", "--cache", tmp_path / "c", "--out", tmp_path / "run", "--steps", 2, "--device", flag)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_cuda_config_on_a_machine_without_cuda_before_it_writes(cache_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA|no CUDA GPU"):
        train(cache_dir, tmp_path / "run", TINY.replace(device="cuda"))
    with pytest.raises(ConfigError, match="not a device"):
        TINY.replace(device="meta")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("before", [(False, False), (True, True)])
def test_train_runs_strict_and_gives_the_process_its_switches_back(cache_dir, tmp_path, before):
    seen = []
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    try:
        train(cache_dir, tmp_path / "run", TINY, on_step=lambda step, report: seen.append(_switches()))
        assert set(seen) == {(True, False)}                  # strict inside, never warn-only
        assert _switches() == before
        with pytest.raises(TrainingDiverged):
            train(cache_dir, tmp_path / "diverged", TINY.replace(lr=1e30))
        assert _switches() == before                         # restored when train raises too
    finally:
        torch.use_deterministic_algorithms(False)


def test_cublas_workspace_is_set_before_cuda_starts_and_refused_after():
    env = {}
    assert devices.ensure_cublas_workspace(env, cuda_initialized=False) == ":4096:8"
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert devices.ensure_cublas_workspace(env, cuda_initialized=True) == ":16:8"
    for value in (None, ":0:0"):
        env = {} if value is None else {"CUBLAS_WORKSPACE_CONFIG": value}
        with pytest.raises(DeterminismError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 before the first CUDA call"):
            devices.ensure_cublas_workspace(env, cuda_initialized=True)
        assert env.get("CUBLAS_WORKSPACE_CONFIG") == value    # nothing half-set


def test_deterministic_on_cuda_sets_the_workspace_before_it_flips_the_switch(monkeypatch):
    order = []
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    real = torch.use_deterministic_algorithms
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: (order.append(
        ("switch", __import__("os").environ.get("CUBLAS_WORKSPACE_CONFIG"))), real(*a, **k)))
    with devices.deterministic("cuda"):
        pass
    assert order[0] == ("switch", ":4096:8")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(DeterminismError), devices.deterministic("cuda"):
        pass
    assert len(order) == 2                                   # refused before touching the switch


# a cold `python -m nblib train ARGS...` that prints, after its own output, every set_deterministic call it made:
# whether Inductor was loaded, the variable it reads after the call, and Inductor's own flag at the switch-off
COLD_TRAIN = """
import atexit, json, os, runpy, sys
import nblib.train.device as device

calls, real = [], device.set_deterministic
def recording(torch, mode, warn_only):
    inductor = sys.modules.get("torch._inductor.config")
    calls.append({"mode": mode, "inductor loaded": inductor is not None,
                  "inductor deterministic": None if inductor is None else inductor.deterministic})
    real(torch, mode, warn_only)
    calls[-1]["variable"] = os.environ.get(device.INDUCTOR_ENV)
device.set_deterministic = recording
atexit.register(lambda: print(json.dumps(calls)))
sys.argv = ["nblib", *sys.argv[1:]]
runpy.run_module("nblib", run_name="__main__", alter_sys=True)
"""


def test_a_cold_train_turns_determinism_on_through_the_variable_and_inductor_reads_it(cache_dir, tmp_path):
    # the in-process CLI tests run where Inductor is loaded already (the other branch); a user's run is cold
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop(devices.INDUCTOR_ENV, None)
    done = subprocess.run([sys.executable, "-c", COLD_TRAIN, "train", "--cache", str(cache_dir), "--out",
                           str(tmp_path / "run"), "--steps", "2", "--batch-size", "16", "--device", "cpu",
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert calls == [
        {"mode": True, "inductor loaded": False, "inductor deterministic": None, "variable": "1"},
        # the optimizer imported Inductor inside the block; its config read the variable: a compile was exact
        {"mode": False, "inductor loaded": True, "inductor deterministic": True, "variable": "1"},
    ], calls


def test_importing_nblib_train_sets_the_workspace_in_a_fresh_process():
    code = "import os, nblib.train; print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'))"
    env = subprocess_env()
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == ":4096:8", done.stderr


def test_an_op_without_a_deterministic_kernel_is_a_typed_error_naming_it(cache_dir, tmp_path, monkeypatch):
    from torch._prims_common import alert_not_deterministic  # the Python twin of the C++ alert CUDA kernels call

    from nblib.train.model import Classifier

    forward = Classifier.forward

    def with_a_nondeterministic_op(self, images):
        alert_not_deterministic("scatter_add_cuda_kernel")
        return forward(self, images)

    monkeypatch.setattr(Classifier, "forward", with_a_nondeterministic_op)
    with pytest.raises(DeterminismError, match="scatter_add_cuda_kernel has no deterministic kernel") as info:
        train(cache_dir, tmp_path / "run", TINY)
    assert "replace the layer" in str(info.value)
    assert not torch.are_deterministic_algorithms_enabled()


# ------------------------------------------------------------------------------ the step


def test_a_step_the_grad_scaler_skips_does_not_advance_the_lr_schedule():
    from nblib.train.loop import train_step, training_objects

    config = TrainConfig(steps=10, warmup_steps=2, batch_size=4, device="cpu")
    for huge, advanced in ((1e35, False), (1.0, True)):
        net = torch.nn.Linear(8, 3)
        optimizer, scheduler, _ = training_objects(net, config)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)      # a real scaler: inf gradients skip
        weights, lr = net.weight.detach().clone(), optimizer.param_groups[0]["lr"]
        batches = iter([(torch.full((4, 8), huge), torch.tensor([0, 1, 2, 0]), torch.arange(4))])
        loss, _ = train_step(net, optimizer, scheduler, scaler, batches, config)
        assert torch.isfinite(torch.tensor(loss))
        assert torch.equal(net.weight, weights) is not advanced     # skipped: weights untouched
        assert (scheduler.last_epoch == 1) is advanced
        assert (optimizer.param_groups[0]["lr"] != lr) is advanced


def test_backward_runs_outside_autocast():
    from nblib.train.loop import train_step, training_objects

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch.is_autocast_enabled("cpu"))
            return grad

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 3)

        def forward(self, x):
            return Probe.apply(self.linear(x))

    config = TrainConfig(steps=10, batch_size=4, precision="bf16", device="cpu")
    net = Net()
    optimizer, scheduler, scaler = training_objects(net, config)
    train_step(net, optimizer, scheduler, scaler, iter([(torch.randn(4, 8), torch.zeros(4, dtype=torch.long),
                                                         torch.arange(4))]), config)
    assert seen == [False]


def test_a_diverging_run_stops_with_one_error_line_and_saves_nothing_non_finite(cache_dir, tmp_path):
    out = tmp_path / "run"
    done = run_nblib("train", "--cache", cache_dir, "--out", out, "--steps", 6, "--batch-size", 16, "--save-every", 1,
                     "--backup-every", 1, "--lr", "1e30", "--device", "cpu", "--no-progress", OMP_NUM_THREADS="1")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: step ") and "lower --lr" in lines[0], done.stderr
    assert not (out / "final.pt").exists()
    for path in (out / "checkpoints").glob("state-*.pt"):
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path.name


# ------------------------------------------------------------------------------ the loader


def test_the_loader_pins_batches_for_cuda_and_never_forks_beside_a_live_thread(cache_dir):
    import numpy as np

    from nblib.train.data import BatchPlan, LabelledImages
    from nblib.train.loop import step_loader, worker_start_method

    labels, plan = np.zeros(80, dtype=np.int64), BatchPlan(np.arange(64), 16, 0)

    def _loader(cache_dir, labels, plan, start, stop, rank, world_size, config):       # the loop's: task.dataset
        return step_loader(LabelledImages(str(cache_dir), labels), None, plan, start, stop, rank, world_size, config)

    assert _loader(cache_dir, labels, plan, 0, 2, 0, 1, TINY.replace(device="cuda")).pin_memory
    assert not _loader(cache_dir, labels, plan, 0, 2, 0, 1, TINY).pin_memory
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert worker_start_method() == "forkserver"
        loader = _loader(cache_dir, labels, plan, 0, 2, 0, 1, TINY.replace(workers=2))
        assert loader.multiprocessing_context.get_start_method() == "forkserver"
        forked = [b[0] for b in loader]
    finally:
        stop.set()
        thread.join()
    inline = [b[0] for b in _loader(cache_dir, labels, plan, 0, 2, 0, 1, TINY)]
    assert len(forked) == len(inline) == 2
    assert all(torch.equal(a, b) for a, b in zip(forked, inline))


def test_a_main_script_forkserver_cannot_import_keeps_fork(monkeypatch):
    from nblib.train.loop import worker_start_method

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(sys.modules["__main__"], "__file__", "<stdin>", raising=False)
        assert worker_start_method() == "fork"                 # python - < script.py: nothing to import
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------ ranks


def test_ddp_on_gpus_trains_over_an_nccl_group_with_device_ids_and_on_cpu_over_gloo(monkeypatch):
    import torch.distributed as dist
    import torch.nn.parallel

    from nblib.train.loop import _wrap

    made, wrapped = [], []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "nccl-group")
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m, **kw: wrapped.append(kw) or m)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    class World:
        size, group = 2, "gloo-group"

    _wrap(torch.nn.Linear(2, 2), World(), "cuda")
    assert made == [{"backend": "nccl"}]
    assert wrapped[-1] == {"device_ids": [3], "output_device": 3, "process_group": "nccl-group"}
    _wrap(torch.nn.Linear(2, 2), World(), "cpu")
    assert wrapped[-1] == {"process_group": "gloo-group"} and len(made) == 1


def test_dropout_seeds_differ_by_rank_and_step_and_repeat_for_the_same_key():
    seeds = {(step, rank): devices.dropout_seed(0, step, rank) for step in range(50) for rank in range(4)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2 ** 63 for s in seeds.values())
    assert devices.dropout_seed(0, 7, 1) == devices.dropout_seed(0, 7, 1) != devices.dropout_seed(1, 7, 1)


def _switches() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def test_deterministic_mode_skips_importing_inductor_yet_a_compile_inside_it_is_deterministic():
    """torch.use_deterministic_algorithms imports Inductor (~1 s a run); the block must not, and must stay exact."""
    code = ("import sys, torch\n"
            "from nblib.train.device import deterministic\n"
            "with deterministic('cpu'):\n"
            "    assert torch.are_deterministic_algorithms_enabled()\n"
            "    assert 'torch._inductor.config' not in sys.modules\n"
            "    import torch._inductor.config as c\n"
            "    assert c.deterministic, 'a compile inside the block would not be deterministic'\n"
            "    print('inside ok')\n"
            "assert not torch.are_deterministic_algorithms_enabled()\n"
            "with deterministic('cpu'):\n"
            "    assert c.deterministic and torch.are_deterministic_algorithms_enabled()\n"
            "assert not c.deterministic and not torch.are_deterministic_algorithms_enabled()\n"
            "print('after ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300)
    assert done.returncode == 0 and "after ok" in done.stdout, done.stderr[-2000:]
