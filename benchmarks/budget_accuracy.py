"""Predicted vs measured peak memory of one encoder forward pass, side by side with ratios.

CPU: peak RSS increase (the kernel's high-water mark) of one forward pass, in a fresh subprocess
per config (nblib.measure.encoder_peak): after model build, a 2-image warm-up, the input batch
and one full pass at that batch size (one-time GEMM workspaces), the second pass's increase is
the steady state every later batch of a long job adds; predicted = the budget's live buffers at
the peak (nblib.budget.forward_peak_delta). The prediction assumes glibc's mmap threshold is
pinned (nblib.malloc.pin_malloc_mmap_threshold). For contrast the last columns show the first
pass (with the one-time workspaces) and the default glibc (first pass, threshold not pinned).
GPU (when CUDA is present): torch.cuda max allocated increase vs the budget's trace of the encode
loop on this GPU (nblib.lab.memory_budgeting.forward_peak: the one VRAM answer, less the input batch).
Targets: CPU 0.85-1.15, GPU 0.9-1.1.

    .venv/bin/python benchmarks/budget_accuracy.py [--quick]
"""
from __future__ import annotations

import argparse
import sys

from nblib import budget, measure
from nblib.config import preset
from nblib.lab import memory_budgeting


def configs(quick: bool):
    """(config, SDPA backend) pairs: smoke (patchify peak), mid (block peak), many tokens (math)."""
    smoke = preset("smoke")
    mid = preset("seed_t4").replace(name="mid", image_size=128, dim=256, heads=4, capsules=8)
    tokens = smoke.replace(name="tokens", image_size=256, patch=8, dim=64, heads=4)
    smoke_sizes = (128, 512) if quick else (64, 256, 1024, 2048)
    mid_sizes = (16, 64) if quick else (16, 32, 64, 128)
    token_sizes = (4,) if quick else (4, 16)
    return ([(smoke.replace(batch_size=b), None) for b in smoke_sizes]
            + [(mid.replace(batch_size=b), None) for b in mid_sizes]
            + [(tokens.replace(batch_size=b), "math") for b in token_sizes])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 batch sizes per model")
    args = parser.parse_args(argv)
    from nblib.env import cuda_available

    ok = True
    print(f"{'config':<7}{'batch':>6}{'peak phase':>18}{'predicted MB':>14}{'steady MB':>11}"
          f"{'ratio':>7}{'1st pass MB':>13}{'ratio':>7}{'glibc default':>15}{'ratio':>7}")
    for cfg, backend in configs(args.quick):
        b = cfg.run.batch_size
        pred = budget.forward_peak_delta(cfg, sdpa_backend=backend or "flash")
        phase = [ln.why for ln in budget.model_memory_lines(cfg, sdpa_backend=backend or "flash")
                 if ln.name == "activations at peak"][0].split("during the ")[1].split(" phase")[0]
        pinned = measure.encoder_peak(cfg, b, sdpa_backend=backend)
        default = measure.encoder_peak(cfg, b, pin_malloc=False,
                                       sdpa_backend=backend)["rss_delta_first"]
        ratio = pinned["rss_delta"] / pred
        ok &= 0.85 <= ratio <= 1.15
        print(f"{cfg.name:<7}{b:>6}{phase:>18}{pred / 1e6:>14.1f}{pinned['rss_delta'] / 1e6:>11.1f}"
              f"{ratio:>7.2f}{pinned['rss_delta_first'] / 1e6:>13.1f}"
              f"{pinned['rss_delta_first'] / pred:>7.2f}{default / 1e6:>15.1f}{default / pred:>7.2f}",
              flush=True)
    print(f"CPU: all ratios within 0.85-1.15: {ok}")
    if cuda_available():
        gpu_ok = True
        print(f"\n{'config':<7}{'batch':>6}{'predicted MB':>14}{'max alloc MB':>14}{'ratio':>7}")
        for cfg, backend in configs(args.quick):
            b = cfg.run.batch_size
            pred = memory_budgeting.forward_peak(cfg, memory_budgeting.this_gpu(), sdpa_backend=backend)
            got = measure.encoder_peak(cfg, b, device="cuda",
                                       sdpa_backend=backend)["cuda_allocated_delta"]
            gpu_ok &= 0.9 <= got / pred <= 1.1
            print(f"{cfg.name:<7}{b:>6}{pred / 1e6:>14.1f}{got / 1e6:>14.1f}{got / pred:>7.2f}",
                  flush=True)
        print(f"GPU: all ratios within 0.9-1.1: {gpu_ok}")
        ok &= gpu_ok
    else:
        print("GPU: no CUDA device here; VRAM accuracy not measured")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
