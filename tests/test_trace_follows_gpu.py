"""The VRAM trace follows what the GPU does (issue 37): the attention mask as the efficient kernel receives it,
cuBLAS workspaces only at cuBLAS GEMMs, one per handle, sized by CUBLAS_WORKSPACE_CONFIG, activation
checkpointing traced, and the T4's capacity as torch reports it.
"""
from __future__ import annotations

import json
import re

import pytest

SHAPE = (32, 4, 49, 32)     # a Swin window batch: [B * windows, heads, 7 x 7 tokens, head dim]


@pytest.fixture(scope="module")
def shim():
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)


def _vit(folder, name: str, checkpointing: bool = False) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128,
                                    image_size=64, patch_size=8).to_dict()
    config["gradient_checkpointing"] = checkpointing      # what from_pretrained / post_init turns on
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return f"hf:ViTModel:{path}"


@pytest.fixture(scope="module")
def vit_training(shim, tmp_path_factory):
    """The plain ViT's training budget at batches 8 and 64 with CUBLAS_WORKSPACE_CONFIG unset: one trace (the second
    batch replays its stream), read by the workspace test and the checkpointing test.
    """
    from nblib.budget.model_vram import model_vram

    spec = _vit(tmp_path_factory.mktemp("vit"), "vit")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        return {b: model_vram(spec, b, train=True, find_largest=False) for b in (8, 64)}


def _attention_peak(with_mask: bool) -> int:
    """Peak live bytes beyond q, k, v and an fp32 bias [B, H, L, L] of SDPA under fp16 autocast, inference."""
    import torch
    import torch.nn.functional as F

    from nblib.budget.trace import DeviceTrace, attention_as_on_gpu, fake_cuda

    b, h, length, d = SHAPE
    with fake_cuda():
        trace = DeviceTrace(75)
        with trace, attention_as_on_gpu(trace), torch.inference_mode():
            q, k, v = (torch.empty(SHAPE, dtype=torch.float16).to("cuda:0") for _ in range(3))
            bias = torch.empty(b, h, length, length).to("cuda:0")
            before = trace.live
            trace.max_live = before
            with torch.autocast("cuda", dtype=torch.float16):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias if with_mask else None, scale=0.2)
            del out
    assert trace.sdpa_used == {"efficient": 1}
    return trace.max_live - before


def test_an_attention_mask_costs_what_the_efficient_kernel_receives():
    """attention.cpp: autocast casts the fp32 mask to fp16, preprocess_mask pads its last dim 49 to 56 (strides not
    a multiple of 8). Measured on an H100 (torch 2.11, the same shapes): the forward's peak rose by these two
    (1,317,376 B there: the same in 512 B granules).
    """
    b, h, length, _ = SHAPE
    cast, padded = b * h * length * length * 2, b * h * length * (length + 8 - length % 8) * 2
    assert _attention_peak(True) - _attention_peak(False) == cast + padded


def test_the_workspace_size_reads_cublas_workspace_config_as_cublas_does():
    from nblib.budget.trace import cublas_workspace_bytes

    assert cublas_workspace_bytes(75, ":4096:8") == 32 * 2**20
    assert cublas_workspace_bytes(75, ":16:8") == 128 * 2**10
    assert cublas_workspace_bytes(75, ":4096:2:16:8") == cublas_workspace_bytes(75) == 4096 * 2**10 * 2 + 16 * 2**10 * 8
    assert cublas_workspace_bytes(90) == 32 * 2**20 and cublas_workspace_bytes(89) == cublas_workspace_bytes(75)
    assert cublas_workspace_bytes(75, "garbage") == cublas_workspace_bytes(75)


def test_a_convolution_takes_no_cublas_workspace_and_a_matmul_takes_one():
    import torch

    from nblib.budget.trace import DeviceTrace, fake_cuda

    conv = torch.nn.Conv2d(3, 8, 3)
    with fake_cuda():
        trace = DeviceTrace(75)
        with trace, torch.inference_mode():
            conv.to("cuda:0")
            y = conv(torch.empty(4, 3, 16, 16).to("cuda:0"))
            assert trace.workspace_bytes == 0 and not [e for e in trace.events if e[0] == "w"]
            y.flatten(1) @ torch.empty(y.flatten(1).shape[1], 4).to("cuda:0")
    assert trace.workspace_bytes == trace.workspace_size and [e[0] for e in trace.events].count("w") == 1


def test_a_cnn_without_linear_gets_no_cublas_workspace_line(shim, tmp_path):
    transformers = pytest.importorskip("transformers")
    from nblib.budget.model_vram import model_vram

    config = tmp_path / "resnet.json"
    transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                              layer_type="basic").to_json_file(config)
    for train in (False, True):
        budget = model_vram(f"hf:ResNetModel:{config}", 8, train=train, find_largest=False)
        # training adds the head's Linear (nblib.models.head): its GEMMs take the workspaces
        assert (budget.line("cuBLAS workspace") == 0) is (not train), budget.table()


def test_a_model_with_linear_gets_one_workspace_per_cublas_handle(shim, tmp_path, monkeypatch):
    """Encoding runs its GEMMs on one thread; training's backward on autograd's device thread, a second handle."""
    from nblib.budget.model_vram import model_vram
    from nblib.budget.trace import cublas_workspace_bytes

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    spec = _vit(tmp_path, "vit")
    encode = model_vram(spec, 8, find_largest=False)
    assert encode.line("cuBLAS workspace") == cublas_workspace_bytes(75)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    train = model_vram(spec, 8, train=True, find_largest=False)
    assert train.line("cuBLAS workspace") == 2 * cublas_workspace_bytes(75, ":16:8")


def test_training_charges_the_32_mib_workspace_nblib_train_sets_per_handle(vit_training, monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    code = "import os, nblib.train; print(os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    run_sets = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert run_sets == ":4096:8"
    assert vit_training[8].line("cuBLAS workspace") == 2 * 4096 * 1024 * 8     # budgeted with the variable unset


def test_a_checkpointed_vit_is_budgeted_and_lower_than_without(vit_training, tmp_path):
    from nblib.budget.model_vram import model_vram

    plain = vit_training[64]
    checkpointed = model_vram(_vit(tmp_path, "vit_ckpt", checkpointing=True), 64, train=True, find_largest=False)
    assert checkpointed.line("parameters and buffers") == plain.line("parameters and buffers")
    assert checkpointed.line("input batch and activations at the peak") < plain.line(
        "input batch and activations at the peak")
    assert checkpointed.total < plain.total


def test_the_t4_limit_is_the_total_memory_torch_reports_on_colab():
    from nblib.budget.devices import DEVICES, T4_TOTAL_MEMORY, T4_TOTAL_MEMORY_SOURCE
    from nblib.budget.model_vram import reserved_cap
    from nblib.budget.resources import FIT_MARGIN

    mib = int(re.search(r"(\d+) MiB as torch prints it", T4_TOTAL_MEMORY_SOURCE)[1])
    assert mib == T4_TOTAL_MEMORY // 2**20 and str(T4_TOTAL_MEMORY) in T4_TOTAL_MEMORY_SOURCE
    assert DEVICES["t4"].vram_bytes == T4_TOTAL_MEMORY
    assert reserved_cap("t4") == int(T4_TOTAL_MEMORY * (1 - FIT_MARGIN)) - DEVICES["t4"].cuda_context_bytes
