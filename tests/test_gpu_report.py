"""benchmarks/gpu_report.py as real subprocesses (--smoke on this CPU, --simulate, --against) and its pieces."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_report.py"
CPU_SDPA = {"default": None, "math": None, "flash": None,      # a CPU kernel exists
            "efficient": "RuntimeError: No viable backend", "cudnn": "RuntimeError: No viable backend"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = module           # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


gpu_report = _module()


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """The simulated report, then a smoke run against it: both JSONs and the second's stdout."""
    out = tmp_path_factory.mktemp("gpu-report")
    sim = _run("--simulate", "--smoke", "--out", str(out / "simulated.json"))
    assert sim.returncode == 0, sim.stderr[-3000:]
    real = _run("--smoke", "--out", str(out / "real.json"), "--against", str(out / "simulated.json"))
    assert real.returncode == 0, real.stderr[-3000:]
    return {"simulated": json.loads((out / "simulated.json").read_text()),
            "real": json.loads((out / "real.json").read_text()), "stdout": real.stdout,
            "sim_stdout": sim.stdout, "path": out / "real.json"}


# ------------------------------------------------------------------ the steps: one list, declared reads
def test_every_read_is_made_by_an_earlier_step():
    gpu_report.check_steps()
    swapped = list(gpu_report.STEPS)
    i = gpu_report.STEP_NAMES.index("candidates")
    swapped.insert(1, swapped.pop(i))                 # candidates before the throughput it reads
    with pytest.raises(AssertionError, match="candidates reads"):
        gpu_report.check_steps(swapped)


def test_the_long_run_is_capped_by_the_measured_rate():
    assert gpu_report.long_run_batches(1000, 448.0, 192, 120.0)[0] == 280   # 120 s at 448 samples/s
    assert gpu_report.long_run_batches(1000, 5000.0, 192, 120.0) == (1000, gpu_report.long_run_batches(
        1000, 5000.0, 192, 120.0)[1])
    n, why = gpu_report.long_run_batches(1000, 10.0, 192, 120.0)
    assert n == 10 and "slope is weak" in why


def test_mfu_uses_the_rate_the_kernels_run_at():
    from nblib import budget

    h100 = budget.device_preset("h100")
    assert gpu_report.peak_flops(h100, "fp16", False) == h100.fp16_flops
    assert gpu_report.peak_flops(h100, "fp32", False) == h100.fp32_flops
    assert gpu_report.peak_flops(h100, "fp32", True) == h100.tf32_flops
    t4 = budget.device_preset("t4")
    assert gpu_report.peak_flops(t4, "fp32", True) == t4.fp32_flops   # no TF32 on a T4


def test_gpu_presets_come_from_the_budget_devices():
    assert gpu_report.gpu_preset("Tesla T4").name == "t4"
    assert gpu_report.gpu_preset("NVIDIA H100 80GB HBM3").name == "h100"
    assert gpu_report.gpu_preset("NVIDIA L40S") is None


# ------------------------------------------------------------------ the smoke run on this CPU
def test_every_section_is_there_and_ran_or_says_why_not(reports):
    report = reports["real"]
    assert report["schema"] == "nblib.gpu_report/1" and report["smoke"] is True
    for name in gpu_report.STEP_NAMES:
        expected = "skipped: no CUDA" if name == "capped_memory" else "ok"
        assert report[name]["status"] == expected, (name, report[name]["status"])


def test_each_attention_backend_runs_or_fails_as_this_cpu_must(reports):
    rows = reports["real"]["throughput"]["rows"]
    assert {r["sdpa_backend"] for r in rows} == set(CPU_SDPA)
    for row in rows:
        error = CPU_SDPA[row["sdpa_backend"]]
        if error is None:
            assert row["error"] is None and row["samples_per_s"] > 0, row
        else:
            assert row["samples_per_s"] is None and row["error"].startswith(error), row


def test_long_run_streaming_and_offload_figures(reports):
    report = reports["real"]
    long_run = report["long_run_vram"]
    assert long_run["batches"] == long_run["batches_asked"] == 30 and long_run["batches_why"].startswith("as asked")
    assert isinstance(long_run["slope_mb_per_1000_batches"], float) and long_run["memory"] == "process RSS"
    assert report["offload"]["async"]["peak_vram_allocated"] is None and report["offload"]["async"]["peak_rss"] > 0
    assert report["streaming_overhead"]["streaming_samples_per_s"] == report["offload"]["async"]["samples_per_s"]


def test_low_precision_outputs_stay_close_to_fp32(reports):
    precision = reports["real"]["precision"]
    for name, bound in (("fp16", 0.01), ("bf16", 0.05)):
        assert 0 < precision[name]["sketch_mean_rel_err"] <= precision[name]["sketch_max_rel_err"] < bound
        assert precision[name]["checksum_bits_agree"] > 0.9


def test_the_t4_projection_is_simulated_and_counts_every_flop(reports):
    projection = reports["real"]["t4_projection"]
    assert projection["label"].startswith("simulated")
    for precision in ("fp32", "fp16"):
        entry = projection[precision]
        assert entry["flops_per_batch"] == pytest.approx(entry["analytic_flops_per_batch"], rel=1e-9)
        r = entry["t4_speed_range"]        # nblib.t4_speed (the smoke model is memory-bound: it may pass the roofline)
        assert r["low"] < r["mid"] < r["high"] and r["label"] == "projection" and "achieved FLOP/s" in r["method"]
        assert entry["t4_calibrated_by_this_gpu"] is None                 # a CPU has no GPU preset


# ------------------------------------------------------------------ --simulate and --against
def test_simulate_writes_the_same_sections_labelled_simulated(reports):
    sim = reports["simulated"]
    assert sim["simulated"] is True
    filled = {"environment", "budget_accuracy", "throughput", "offload", "t4_projection", "capped_memory"}
    for name in gpu_report.STEP_NAMES:
        if name in filled:
            assert sim[name]["status"] == "ok" and "simulated" in sim[name].get("label", ""), name
        else:
            assert sim[name]["status"] == "skipped: not simulated (needs a GPU)", name
    held, offloaded = sim["offload"]["consolidate"], sim["offload"]["async"]    # consolidate keeps K batches' outputs
    assert held["peak_vram_allocated"] > offloaded["peak_vram_allocated"] > 0
    assert held["peak_vram_reserved"] >= offloaded["peak_vram_reserved"] > 0   # the same 2 MiB segments may hold both
    assert "SIMULATED T4" in reports["sim_stdout"]


def test_a_real_run_prints_measured_over_simulated(reports):
    out = reports["stdout"]
    assert "measured here / simulated T4" in out and f"wrote {reports['path']}" in out
    fp32 = next(line for line in out.splitlines() if "samples/s fp32" in line)
    measured = reports["real"]["throughput"]["rows"][0]["samples_per_s"]
    simulated = reports["simulated"]["throughput"]["rows"][0]["samples_per_s"]
    assert f"ratio {measured / simulated:.3f}" in fp32


@pytest.mark.parametrize("args", [("--bogus",), ("--smoke", "--compile-modes", "turbo"), ("--repeats", "0")])
def test_a_bad_flag_exits_2_with_one_line(args, capsys):
    # in this process: parsing is all a bad flag reaches (a subprocess would only import torch again)
    with pytest.raises(SystemExit) as exited:
        gpu_report.main(list(args))
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and "error" in stderr


def test_a_cuda_run_compares_the_traced_vram_lines_of_the_budget():
    """On CUDA, budget_accuracy reads predict_budget's VRAM lines (the trace's ModelVRAM lines), not older names."""
    from nblib.budget import predict_budget
    from nblib.budget.encode_trace import encode_vram
    from nblib.config import preset

    cfg = preset("smoke").replace(consolidate_every=1, checkpoint_every=1)
    predicted = predict_budget(cfg, "t4")
    measured = {"weights": 1, "max_allocated": 3, "max_reserved": 4, "context": 5, "driver_used": 6,
                "nvidia_smi_used": None}
    pairs = {name: (p, m) for name, p, m in gpu_report.vram_pairs(predicted, measured)}
    traced = encode_vram(cfg, "t4")
    assert pairs["reserved at peak (+ allocator cache)"] == (traced.reserved, 4)
    assert pairs["parameters and buffers"] == (traced.line("parameters and buffers"), 1)
    assert pairs["CUDA context (driver - reserved)"] == (traced.line("CUDA context"), 5)
    assert pairs["VRAM total (mem_get_info)"] == (predicted.totals["vram"], 6)


@pytest.mark.parametrize("text,expected", [("15360", 15360.0), (" 1234.5 ", 1234.5), ("[N/A]", None),
                                           ("[Not Supported]", None), ("", None), ("N/A", None)])
def test_nvidia_smi_fields_read_as_numbers_or_none(text, expected):
    assert gpu_report.smi_number(text) == expected


@pytest.mark.parametrize("visible,index,expected", [
    (None, 0, "0"), ("", 0, None), ("2,3", 0, "2"), ("2,3", 1, "3"),
    ("GPU-8f3c1e2a-0000-1111-2222-333344445555", 0, "GPU-8f3c1e2a-0000-1111-2222-333344445555"),
    ("MIG-GPU-aaaa/1/0", 0, "MIG-GPU-aaaa/1/0"), ("1", 3, None)])
def test_the_nvidia_smi_id_of_a_torch_device_follows_cuda_visible_devices(visible, index, expected):
    assert gpu_report.smi_device_id(visible, index) == expected


def test_emulated_bf16_is_not_native():
    def fake(native: bool):
        def supported(including_emulation=True):
            return True if including_emulation else native
        return types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, is_bf16_supported=supported))

    assert gpu_report.bf16_native(fake(False)) is False     # a T4: bf16 only through emulation
    assert gpu_report.bf16_native(fake(True)) is True
