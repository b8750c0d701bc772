"""The traced VRAM budget of any model (nblib.budget.model_vram) against the simulated jobs, the CLI, the GPU twin."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tiny_configs(folder: Path) -> dict[str, str]:
    transformers = pytest.importorskip("transformers")
    vit = folder / "vit.json"
    transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                           image_size=32, patch_size=8).to_json_file(vit)
    resnet = folder / "resnet.json"
    transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                              layer_type="basic").to_json_file(resnet)
    return {"vit": f"hf:ViTModel:{vit}", "resnet": f"hf:ResNetModel:{resnet}", "trm": "trm:smoke"}


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    from nblib.simulate.train import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    return _tiny_configs(tmp_path_factory.mktemp("configs"))


def test_the_cublas_workspace_comes_after_the_first_gemms_output():
    """PyTorch's order (Blas.cpp structured addmm, CublasHandlePool.cpp): output first, workspace second."""
    import torch

    from nblib.budget.trace import WORKSPACE_POSITIONS, DeviceTrace, fake_cuda, replay_events

    with fake_cuda():
        trace = DeviceTrace(75)
        with trace:
            a = torch.empty(512, 512).to("cuda:0")
            b = a @ a
            del b
    kinds = [e[0] for e in trace.events]
    w = kinds.index("w")
    assert kinds[w - 1] == "m" and trace.events[w - 1][2] == 512 * 512 * 4      # the mm's output, then the workspace
    by_pos = trace.reserved_by_position()
    assert by_pos[WORKSPACE_POSITIONS[0]] == trace.allocator.max_reserved == replay_events(trace.events)
    assert set(by_pos) == set(WORKSPACE_POSITIONS)


@pytest.mark.slow
@pytest.mark.parametrize("train", [False, True], ids=["encode", "train"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("name", ["trm", "vit", "resnet"])
def test_the_budget_is_within_ten_percent_of_the_simulated_job(specs, name, precision, train):
    from nblib.budget.model_vram import model_vram
    from nblib.simulate.model import simulate_model

    for batch in (8, 40):
        budget = model_vram(specs[name], batch, precision=precision, train=train, find_largest=False)
        sim = simulate_model(specs[name], batch, precision=precision, train=train)
        assert 0.9 <= budget.reserved / sim.max_reserved <= 1.1, (batch, budget.reserved, sim.max_reserved)
        assert budget.high >= budget.total and budget.line("CUDA context") == 400_000_000


@pytest.mark.slow
def test_budget_cli_prints_json_lines_in_bytes_and_refuses_what_does_not_fit(specs):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "nblib", "budget", "--model", specs["vit"], "--batch-size", "8",
                           "--train", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert sum(line["bytes"] for line in out["vram_lines"]) == out["total_bytes"]
    assert out["high_bytes"] == out["total_bytes"] + out["workspace_margin_bytes"]
    assert out["fits"] and out["largest_batch"] >= 8 and out["fit_margin"] == 0.1
    big = out["largest_batch"] * 4
    done = subprocess.run([sys.executable, "-m", "nblib", "budget", "--model", specs["vit"], "--batch-size", str(big),
                           "--train"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2
    assert "does NOT fit" in done.stdout and f"--batch-size {out['largest_batch']}" in done.stderr
    assert "GB of VRAM" in done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["encode", "train"])
@pytest.mark.parametrize("spec", ["trm", "hf:ViTModel", "hf:ResNetModel"])
def test_budget_and_simulation_against_max_memory_reserved_on_a_gpu(spec, train):
    """On a real GPU: the measured max_memory_reserved against the traced budget (no CUDA context)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    pytest.skip("the budget traces in a CPU-only torch process with the fake-CUDA shim; on a CUDA build the "
                "shim refuses (nblib.budget.shim): run benchmarks/model_budget_vs_simulated.py on a CPU machine, "
                "then this measurement on the GPU, and compare")
