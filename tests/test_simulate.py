"""The simulated T4 (nblib.simulate): the allocator model rule by rule, the fake CUDA device, the
trace against MemTracker and measured RSS, the roofline, and the budget against the simulation.
"""
from __future__ import annotations

import pytest
import torch

from nblib import budget
from nblib.budget import allocator as A
from nblib.budget.allocator import CachingAllocatorModel
from nblib.config import preset
from nblib.errors import ConfigError

MiB = 1 << 20


# ------------------------------------------------------------------ the allocator model
def test_requests_round_up_to_512_bytes():
    assert [A.round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]


def test_segment_sizes_follow_the_default_policy():
    assert A.segment_size(A.round_size(1)) == 2 * MiB            # small pool: 2 MiB segments
    assert A.segment_size(1 * MiB) == 2 * MiB
    assert A.segment_size(1 * MiB + 512) == 20 * MiB             # 1-10 MiB: a 20 MiB segment
    assert A.segment_size(10 * MiB - 512) == 20 * MiB
    assert A.segment_size(10 * MiB) == 10 * MiB                  # >= 10 MiB: rounded to 2 MiB
    assert A.segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_one_segment_and_large_ones_split_a_20_mib_one():
    alloc = CachingAllocatorModel()
    for _ in range(4):
        alloc.malloc(500 * 1024)                 # 4 x 500 KiB fit one 2 MiB segment
    assert alloc.segments == [2 * MiB]
    alloc.malloc(3 * MiB)
    alloc.malloc(3 * MiB)                        # the 20 MiB segment is split for both
    assert alloc.segments == [2 * MiB, 20 * MiB]
    assert alloc.allocated == 4 * 500 * 1024 + 6 * MiB


def test_best_fit_reuses_the_smallest_free_block_that_fits():
    alloc = CachingAllocatorModel()
    a, b = alloc.malloc(40 * MiB), alloc.malloc(24 * MiB)
    alloc.free(a)
    alloc.free(b)
    alloc.malloc(22 * MiB)                       # takes the 24 MiB block, not the 40 MiB one
    alloc.malloc(38 * MiB)                       # fits the 40 MiB block: no new segment
    assert alloc.reserved == 64 * MiB and len(alloc.segments) == 2


def test_a_large_block_is_split_only_when_more_than_1_mib_remains():
    alloc = CachingAllocatorModel()
    alloc.free(alloc.malloc(12 * MiB))
    h = alloc.malloc(11 * MiB + 512)             # remainder < 1 MiB: the whole 12 MiB block
    assert alloc.allocated == 12 * MiB
    alloc.free(h)
    alloc.malloc(10 * MiB)                        # remainder 2 MiB: split
    assert alloc.allocated == 10 * MiB


def test_freed_neighbours_coalesce():
    alloc = CachingAllocatorModel()
    hs = [alloc.malloc(3 * MiB) for _ in range(6)]   # one 20 MiB segment, six 3 MiB blocks
    for h in hs:
        alloc.free(h)
    alloc.malloc(18 * MiB)                        # fits only if the six merged back with the tail
    assert len(alloc.segments) == 1 and alloc.max_reserved == 20 * MiB


# ------------------------------------------------------------------ the fake CUDA device
def test_fake_cuda_runs_cuda_autocast_and_restores_the_guard():
    from torch.cuda.amp import common

    from nblib.budget.trace import fake_cuda

    guard = common.amp_definitely_not_available
    with fake_cuda():
        a = torch.empty(4, 8, device="cuda:0")
        with torch.autocast("cuda", dtype=torch.float16):
            out = a @ torch.empty(8, 2, device="cuda:0")
        assert out.device.type == "cuda" and out.dtype == torch.float16
    assert common.amp_definitely_not_available is guard


def test_a_t4_runs_efficient_attention_and_refuses_flash():
    from nblib.simulate import simulate_encode

    cfg = preset("smoke")
    run = simulate_encode(cfg, "t4", batches=1)
    assert run.sdpa_backend == "efficient" and run.label == "simulated"
    assert simulate_encode(cfg, "h100", batches=1).sdpa_backend == "flash"
    with pytest.raises(ConfigError, match="sm_80"):
        simulate_encode(cfg, "t4", sdpa_backend="flash", batches=1)
    with pytest.raises(ConfigError, match="no GPU"):
        simulate_encode(cfg, "cpu")


def test_the_trace_counts_every_kernel_flop_of_the_budget():
    from nblib.simulate import simulate_encode

    cfg = preset("smoke")
    run = simulate_encode(cfg, "t4", batches=1)
    assert run.flops_per_image == pytest.approx(budget.flops_per_image(cfg.model), rel=1e-9)


def test_trace_peak_equals_memtracker_peak():
    from simulate_checks import live_vs_memtracker

    for precision in ("fp16", "fp32"):
        agreement = live_vs_memtracker(preset("smoke"), 16, precision)
        assert agreement.simulated == agreement.reference, str(agreement)


def test_traced_live_bytes_match_measured_rss_growth():
    from simulate_checks import live_vs_rss

    cfg = preset("smoke").replace(dim=256, heads=4)   # buffers of 0.5 MB: above glibc's mmap threshold
    # RSS is sampled every 10 ms, so a loaded machine can only make it miss the peak (read low):
    # the highest of up to three fresh measurements is the one to compare
    readings = []
    for _ in range(3):
        readings.append(live_vs_rss(cfg, 32))
        if abs(readings[-1].simulated - readings[-1].reference) < 0.5e6:
            break
    agreement = max(readings, key=lambda a: a.reference)
    assert abs(agreement.simulated - agreement.reference) < 0.5e6, [str(a) for a in readings]


def test_async_offload_holds_no_outputs_consolidate_holds_them():
    from nblib.simulate import simulate_encode

    cfg = preset("smoke").replace(batch_size=64, consolidate_every=4, checkpoint_every=4)
    a = simulate_encode(cfg, "t4", offload="async")
    c = simulate_encode(cfg, "t4", offload="consolidate")
    held = 3 * budget.output_bytes_per_batch(cfg)
    assert c.max_live - a.max_live >= held


# ------------------------------------------------------------------ the roofline
def test_roofline_of_a_t4_fp16_beats_fp32_and_sums_its_kernels():
    from nblib.simulate import simulate_encode
    from nblib.simulate.roofline import calibrated_rate, roofline

    cfg = preset("smoke")
    half = simulate_encode(cfg, "t4", precision="fp16", batches=1)
    full = simulate_encode(cfg, "t4", precision="fp32", batches=1)
    r16, r32 = roofline(half.kernels, 32, "t4"), roofline(full.kernels, 32, "t4")
    assert r16.seconds == pytest.approx(r16.compute_bound_s + r16.memory_bound_s)
    assert r16.samples_per_s > r32.samples_per_s
    assert calibrated_rate(r16, r32, r32.samples_per_s / 2) == pytest.approx(r16.samples_per_s / 2)
    assert roofline(half.kernels, 32, "h100").seconds < r16.seconds


# ------------------------------------------------------------------ the budget against the simulation
GRID = [  # (preset, gpu, precision, offload, batch, sdpa): each precision x offload once, batches spread over
    # 8..384; benchmarks/budget_vs_simulated.py runs the whole T4 grid (64 points). t4/fp32/consolidate/128
    # was 1.19 while the budget replayed a synthetic block pattern instead of the loop's op order. seed_t4/fp32/
    # async/8 and t4/fp32/consolidate/32 are held to the byte by the workspace test below (its jobs, a 32 MiB
    # workspace where this grid has the default 8 MiB: one code path, one number apart).
    ("seed_t4", "t4", "fp16", "async", 384, None),
    ("t4", "t4", "fp16", "consolidate", 192, None), ("t4", "t4", "fp32", "consolidate", 128, None),
    ("seed_t4", "t4", "fp16", "async", 192, None),     # issue 28: 1.63 GB with the workspace first, 1.87 in order
    ("t4", "t4", "fp16", "async", 32, "math"), ("t4", "h100", "fp16", "async", 64, None),
]


@pytest.mark.parametrize("name,gpu,precision,offload,batch,sdpa", GRID)
def test_budget_vram_within_10_percent_of_the_simulated_gpu(name, gpu, precision, offload, batch, sdpa):
    from nblib.simulate import simulate_encode

    cfg = preset(name).replace(batch_size=batch)
    sim = simulate_encode(cfg, gpu, precision=precision, offload=offload, sdpa_backend=sdpa)
    b = budget.predict_budget(cfg, gpu, precision=precision, offload=offload,
                              **({"sdpa_backend": sdpa} if sdpa else {}))
    margin = sum(line.bytes for line in b.lines["vram"] if line.name == "workspace placement margin")
    ratio = (b.totals["vram"] - b.device.cuda_context_bytes - margin) / sim.max_reserved   # PyTorch's order
    assert 0.9 <= ratio <= 1.1, f"budget / simulated reserved = {ratio:.3f}"
    assert b.totals["vram"] - b.device.cuda_context_bytes >= sim.max_reserved * 0.98   # the high end covers it
    # the budget is the trace of the encode loop (nblib.budget.encode_trace), the simulation runs the loop
    # itself: they differ only by the batches run before the steady state
    assert ratio == pytest.approx(1, abs=0.02), f"the budget's trace drifted from the loop: {ratio:.3f}"


@pytest.mark.parametrize("name,offload,batch", [("seed_t4", "async", 8), ("t4", "consolidate", 32)])
def test_the_budget_and_the_simulation_size_the_cublas_workspace_by_the_same_run_config(monkeypatch, name, offload,
                                                                                         batch):
    # a process that imported nblib.train has CUBLAS_WORKSPACE_CONFIG=:4096:8: the budget sized its workspace by it,
    # the simulation did not, and they parted by 1.03x and 0.925x (a test worker that ran a training test first)
    from nblib.simulate import simulate_encode

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg = preset(name).replace(batch_size=batch)
    sim = simulate_encode(cfg, "t4", precision="fp32", offload=offload)
    b = budget.predict_budget(cfg, "t4", precision="fp32", offload=offload)
    margin = sum(line.bytes for line in b.lines["vram"] if line.name == "workspace placement margin")
    assert b.totals["vram"] - b.device.cuda_context_bytes - margin == sim.max_reserved


def test_the_t4_time_is_the_sourced_range_under_the_simulated_roofline():
    """One T4 speed: the full run's time is the budget's nblib.t4_speed range, under the simulated ceiling."""
    from nblib import t4_speed
    from nblib.lab.simulated_t4 import full_run_time

    t4_time = full_run_time()
    b = budget.predict_budget(preset("seed_t4"), "t4")
    assert t4_time.speed == b.speed and t4_time.samples_per_s == b.samples_per_s == b.speed.samples_per_s.mid
    assert t4_time.samples_per_s == pytest.approx(t4_speed.seed_t4().samples_per_s.mid, rel=1e-3)
    assert t4_time.speed.samples_per_s.high < t4_time.roofline_samples_per_s       # a roofline is a ceiling
    text = str(t4_time)
    assert t4_time.speed.hours_text() in text and t4_time.speed.rate_text() in text and "projection" in text
