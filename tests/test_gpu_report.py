"""benchmarks/gpu_report.py --smoke as a real subprocess: every section, numbers where CPU gives them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_report.py"
SECTIONS = ("environment", "budget_accuracy", "throughput", "throughput_compiled", "candidates",
            "long_run_vram", "offload", "streaming_overhead", "precision", "t4_projection", "capped_memory")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu-report")
    proc = _run("--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.glob("smoke-cpu-*.json"))
    assert len(files) == 1, list(out.iterdir())
    return json.loads(files[0].read_text()), proc.stdout, files[0]


def test_every_section_is_there_and_ran_or_says_why_not(smoke_report):
    report, _, _ = smoke_report
    assert report["schema"] == "nblib.gpu_report/1" and report["smoke"] is True
    for name in SECTIONS:
        assert report[name]["status"] in ("ok", "skipped: no CUDA"), (name, report[name]["status"])
    assert report["capped_memory"]["status"] == "skipped: no CUDA"
    assert report["environment"]["reference_config"] == "smoke"


def test_throughput_has_positive_rates_and_unavailable_kernels_as_errors(smoke_report):
    rows = smoke_report[0]["throughput"]["rows"]
    default = [r for r in rows if r["sdpa_backend"] == "default" and r["precision"] == "fp32"]
    assert {r["batch"] for r in default} == {smoke_report[0]["environment"]["reference_batch"],
                                             smoke_report[0]["environment"]["max_batch"]}
    assert all(r["samples_per_s"] > 0 and r["error"] is None for r in default)
    assert {r["sdpa_backend"] for r in rows} == {"default", "math", "efficient", "flash", "cudnn"}
    for row in rows:   # every row has a rate or says what failed (efficient/cudnn have no CPU kernel)
        assert (row["samples_per_s"] or 0) > 0 or row["error"]
    compiled = smoke_report[0]["throughput_compiled"]["rows"]
    assert compiled and all(r["compile"] == "default" and (r["samples_per_s"] or 0) > 0 for r in compiled)


def test_long_run_slope_is_a_float_over_every_batch(smoke_report):
    long_run = smoke_report[0]["long_run_vram"]
    assert long_run["batches"] == 30
    assert isinstance(long_run["slope_mb_per_1000_batches"], float)
    assert long_run["memory"] == "process RSS" and long_run["samples_per_s"] > 0


def test_streaming_offload_and_budget_figures_are_numbers(smoke_report):
    report = smoke_report[0]
    assert report["offload"]["async"]["samples_per_s"] > 0 < report["offload"]["consolidate"]["samples_per_s"]
    assert report["offload"]["async"]["peak_vram_allocated"] is None       # no CUDA: VRAM is None, RSS is there
    assert report["offload"]["async"]["peak_rss"] > 0
    assert report["streaming_overhead"]["ratio"] > 0
    rows = report["budget_accuracy"]["rows"]
    assert len(rows) == 3 and all(line["ratio"] > 0 for row in rows for line in row["lines"])


def test_low_precision_outputs_stay_close_to_fp32(smoke_report):
    precision = smoke_report[0]["precision"]
    for name, bound in (("fp16", 0.01), ("bf16", 0.05)):
        assert 0 < precision[name]["sketch_mean_rel_err"] <= precision[name]["sketch_max_rel_err"] < bound
        assert precision[name]["checksum_bits_agree"] > 0.9


def test_t4_projection_is_labelled_and_counts_the_model_flops(smoke_report):
    projection = smoke_report[0]["t4_projection"]
    assert projection["label"].startswith("PROJECTION")
    for precision in ("fp32", "fp16"):
        entry = projection[precision]
        assert 0.9 < entry["flops_per_batch"] / entry["analytic_flops_per_batch"] <= 1.0   # CPU attention is uncounted
        assert entry["t4_roofline_samples_per_s"] > 0 and entry["bytes_per_batch"] > 0


def test_candidates_name_the_fastest_and_the_table_is_printed(smoke_report):
    report, stdout, path = smoke_report
    candidates = report["candidates"]
    assert candidates["fastest"] in candidates["samples_per_s"]
    assert candidates["recommendation"].startswith("SMOKE")
    assert "PROJECTION" in stdout and f"wrote {path}" in stdout


@pytest.mark.parametrize("args", [("--bogus",), ("--smoke", "--compile-modes", "turbo"), ("--repeats", "0")])
def test_a_bad_flag_exits_2_with_one_line(args):
    proc = _run(*args, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr
