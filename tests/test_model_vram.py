"""The traced VRAM budget of any model (nblib.budget.model_vram) against the simulated jobs, the CLI, the GPU twin."""
from __future__ import annotations

import json
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

    from nblib.budget.allocator import replay_stats
    from nblib.budget.trace import WORKSPACE_POSITIONS, DeviceTrace, fake_cuda

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
    assert by_pos[WORKSPACE_POSITIONS[0]] == trace.allocator.max_reserved == replay_stats(trace.events)["max_reserved"]
    assert set(by_pos) == set(WORKSPACE_POSITIONS)


# Every model encodes at fp16 (autocast: what jobs run by default) and the HF models train at fp16 (autocast and
# the GradScaler); fp32 (neither) is one code path whatever the model: the ViT runs it (attention, cuBLAS GEMMs,
# LayerNorm). The TRM's training budget is held to its simulation to the byte, at a batch neither trace ran, by
# test_training_vram_one_answer (trm:t4: the same Classifier step, a larger shape), its fp32 encode by
# test_simulate's grid (seed_t4 and t4).
JOBS = [("trm", "fp16", False), *((name, "fp16", train) for name in ("vit", "resnet") for train in (False, True)),
        ("vit", "fp32", False), ("vit", "fp32", True)]


@pytest.mark.slow
@pytest.mark.parametrize("name,precision,train", JOBS,
                         ids=[f"{n}-{p}-{'train' if t else 'encode'}" for n, p, t in JOBS])
def test_the_budget_is_within_ten_percent_of_the_simulated_job(specs, name, precision, train):
    from nblib.budget.model_vram import model_vram
    from nblib.simulate.model import simulate_model

    for batch in (8, 40):
        budget = model_vram(specs[name], batch, precision=precision, train=train, find_largest=False)
        sim = simulate_model(specs[name], batch, precision=precision, train=train)
        assert 0.9 <= budget.reserved / sim.max_reserved <= 1.1, (batch, budget.reserved, sim.max_reserved)
        assert budget.high >= budget.total and budget.line("CUDA context") == 400_000_000


def test_the_encode_budget_holds_what_the_encode_loop_holds(specs, tmp_path):
    """The batch's uint8 images stay on the device through its forward, and each output's cast to the stored
    dtype sits beside the outputs (nblib.encode.run's loop, HostPart.add): with 224x224 images and a narrow
    model, a budget without them was 18% short of the simulated loop (0.822).
    """
    transformers = pytest.importorskip("transformers")
    from nblib.budget.model_vram import model_vram
    from nblib.simulate.model import simulate_model

    config = tmp_path / "clip.json"
    transformers.CLIPVisionConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=1024,
                                  image_size=224, patch_size=16).to_json_file(config)
    spec = f"hf:CLIPVisionModel:{config}"
    budget = model_vram(spec, 256, precision="fp16", find_largest=False)
    sim = simulate_model(spec, 256, precision="fp16")
    assert 0.99 <= budget.reserved / sim.max_reserved <= 1.01, (budget.reserved, sim.max_reserved)


@pytest.mark.parametrize("train", [False, True], ids=["encode", "train"])
def test_a_jobs_next_batch_is_a_replay_in_this_process_equal_to_a_fresh_trace_to_the_byte(specs, train,
                                                                                          monkeypatch):
    """model_vram keeps a batch-affine job's allocation stream: another batch, and the largest batch's search,
    run no child, and the replayed batch equals the child's own trace of that batch (no replay) to the byte.
    """
    from dataclasses import replace
    from importlib import import_module

    from nblib.budget.devices import device_preset

    mv = import_module("nblib.budget.model_vram")          # the module (nblib.budget's model_vram is the function)

    spec = specs["vit"]
    mv.model_vram(spec, 4, train=train, find_largest=False)                # traced: the job's stream is kept
    child = mv.run_job

    def no_child(*args, **kwargs):
        raise AssertionError("a kept job ran a child")

    monkeypatch.setattr(mv, "run_job", no_child)
    replayed = mv.model_vram(spec, 11, train=train)
    assert replayed.largest_batch > 11
    payload = {**mv.model_payload(spec), "precision": "fp16", "train": train, "output": None, "classes": 12,
               "cc": device_preset("t4").compute_capability, "out_dtype": mv.OUT_DTYPE, "batches": [11],
               "cap": mv.reserved_cap("t4"), "search": False, "max_batch": 11, "replay": False}
    traced = child(mv.job_for("train" if train else "encode"), payload)
    assert traced["stream"] is None
    fresh = mv._budget(payload, device_preset("t4"), 11, traced["points"][0], None, tuple(traced["nondeterministic"]))
    bytes_of = lambda v: ([(ln.name, ln.bytes) for ln in v.lines], v.reserved_by_position, v.workspace_margin)
    assert bytes_of(replayed) == bytes_of(fresh)
    # the op named at the peak is the traced batch's (3); at batch 11 a tie may name another: all else is equal
    assert replace(replayed, largest_batch=None, lines=fresh.lines, peak_op=fresh.peak_op) == fresh


def test_where_files_go_does_not_trace_a_job_again_but_the_allocator_config_does(specs, monkeypatch, tmp_path):
    """A trace reads no output or Drive folder: a notebook (or a test) that moves them replays the job kept here;
    PYTORCH_CUDA_ALLOC_CONF shapes the allocator, so it is a new job.
    """
    from importlib import import_module

    mv = import_module("nblib.budget.model_vram")
    mv.model_vram(specs["vit"], 4, find_largest=False)                     # kept (traced now or by a test above)
    asked = []

    def child(job, payload, timeout_s=600.0):
        asked.append(payload["batches"])
        raise LookupError("a child was asked")

    monkeypatch.setattr(mv, "run_job", child)
    monkeypatch.setenv("NBLIB_OUTPUTS", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("NBLIB_DRIVE_DIR", str(tmp_path / "other-drive"))
    assert mv.model_vram(specs["vit"], 5, find_largest=False).reserved > 0
    assert asked == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(LookupError):
        mv.model_vram(specs["vit"], 5, find_largest=False)
    assert asked == [[5]]


def test_a_job_that_is_not_batch_affine_is_traced_by_its_child_every_time(monkeypatch):
    """The child answers points, not a stream, for a job whose allocations are not affine in the batch: nothing
    is kept, and the next call asks the child again (which traces that batch itself).
    """
    from importlib import import_module

    mv = import_module("nblib.budget.model_vram")
    asked = []
    point = {"weights": 1, "resident": 1, "workspace": 0, "max_allocated": 2, "reserved_pytorch": 2 << 20,
             "reserved": {"after the first GEMM's output": 2 << 20}, "peak_op": "aten.mm"}

    def child(job, payload, timeout_s=600.0):
        asked.append(payload["batches"])
        return {"stream": None, "points": [point for _ in payload["batches"]], "nondeterministic": [],
                "largest": 7}

    monkeypatch.setattr(mv, "run_job", child)
    first = mv.model_vram("hf:NotAffine:none", 3)
    second = mv.model_vram("hf:NotAffine:none", 5)
    assert asked == [[3], [5]] and first.largest_batch == second.largest_batch == 7


@pytest.mark.slow
def test_budget_cli_prints_json_lines_in_bytes_and_refuses_what_does_not_fit(specs):
    """Output and exit status only: `budget` in this process (cli_runner), so its second run replays the first's
    trace, as a user's second question in one session does.
    """
    from cli_runner import run_nblib

    done = run_nblib("budget", "--model", specs["vit"], "--batch-size", "8", "--train", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert sum(line["bytes"] for line in out["vram_lines"]) == out["total_bytes"]
    assert out["high_bytes"] == out["total_bytes"] + out["workspace_margin_bytes"]
    assert out["fits"] and out["largest_batch"] >= 8 and out["fit_margin"] == 0.1
    done = run_nblib("budget", "--model", specs["vit"], "--batch-size", "1000000", "--train", "--json")
    assert done.returncode == 2, done.stderr
    refused = json.loads(done.stdout)
    assert not refused["fits"] and refused["high_bytes"] > 0.9 * refused["limit_bytes"]
    assert 8 <= refused["largest_batch"] < 1_000_000
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error:") and f"--batch-size {refused['largest_batch']} or less" in error
    assert f"{refused['high_bytes'] / 1e9:.2f} GB of VRAM" in error


GPU_RESULTS = ROOT / "outputs" / "gpu_model_vram.json"


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["encode", "train"])
@pytest.mark.parametrize("spec", ["trm", "hf:ViTModel", "hf:ResNetModel"])
def test_budget_and_simulation_against_max_memory_reserved_on_a_gpu(spec, train):
    """On a real GPU: torch.cuda.max_memory_reserved() of the job against the traced budget and the simulation.

    Results are appended to outputs/gpu_model_vram.json (send that file back).
    """
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    from nblib.budget.model_vram import model_vram
    from nblib.models import load_model
    from nblib.simulate.model import simulate_model

    batch, precision = 32, "fp16"
    budget = model_vram(spec, batch, "t4", precision=precision, train=train, find_largest=False)
    sim = simulate_model(spec, batch, precision=precision, train=train)
    measured = _measure_on_gpu(load_model(spec), batch, train)
    row = {"spec": spec, "train": train, "batch": batch, "precision": precision, "gpu": torch.cuda.get_device_name(),
           "measured_reserved": measured, "budget_reserved": budget.reserved, "budget_high": budget.high
           - budget.line("CUDA context"), "simulated_reserved": sim.max_reserved}
    GPU_RESULTS.parent.mkdir(exist_ok=True)
    rows = json.loads(GPU_RESULTS.read_text()) if GPU_RESULTS.exists() else []
    GPU_RESULTS.write_text(json.dumps(rows + [row], indent=1))
    assert 0.9 <= budget.reserved / measured <= 1.1, row
    assert 0.9 <= sim.max_reserved / measured <= 1.1, row


def _measure_on_gpu(loaded, batch: int, train: bool) -> int:
    import torch

    from nblib.models.head import _image_size
    from nblib.models.outputs import named_outputs
    from nblib.train.config import TrainConfig
    from nblib.train.loop import train_step, training_objects
    from nblib.train.task import loop_module

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    size = _image_size(loaded)
    host = torch.zeros(batch, size, size, 3, dtype=torch.uint8)
    if not train:
        loaded.module.to("cuda")
        for _ in range(3):
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
                outputs = named_outputs(loaded.module(loaded.preprocessing.apply(host.to("cuda"))))
            del outputs
    else:       # what `train` runs: the loop's module (the TRM's Classifier), its training_objects and train_step
        config = TrainConfig(batch_size=batch, precision="fp16", device="cuda", steps=4, warmup_steps=1)
        net = loop_module(loaded, 12, None, size).to("cuda")
        optimizer, scheduler, scaler = training_objects(net, config)
        batches = iter([(host, torch.zeros(batch, dtype=torch.int64), torch.arange(batch))] * 3)
        for _ in range(3):
            train_step(net, optimizer, scheduler, scaler, batches, config)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved()
