"""The budget's VRAM against the simulated T4, on the grid: presets x precision x offload x batch.

    PYTHONPATH=. python benchmarks/budget_vs_simulated.py            # the whole grid (~10 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/budget_vs_simulated.py --batches 64,192,384 --presets seed_t4

Each row: the simulated max_memory_reserved (nblib.simulate.simulate_encode, the real encoder and
the encode loop's device-side steps on a fake T4), the budget's VRAM without the CUDA context (an
assumption no simulation sees), and budget / simulated. Simulated results are cached per torch
version and grid point under outputs/simulate/ (delete the folder after changing nblib.simulate).
Every figure is simulated; none is measured on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from nblib import budget
from nblib.atomic import atomic_write_json
from nblib.config import preset
from nblib.env import outputs_dir
from nblib.simulate import simulate_encode

BATCHES = (8, 16, 32, 64, 128, 192, 256, 384)


def simulated_reserved(name: str, precision: str, offload: str, batch: int, cache: dict) -> int:
    key = f"{name}/{offload}/{precision}/{batch}"
    if key not in cache:
        run = simulate_encode(preset(name).replace(batch_size=batch), "t4", precision=precision, offload=offload)
        cache[key] = {"max_reserved": run.max_reserved, "max_allocated": run.max_allocated,
                      "peak_op": run.peak_op}
    return cache[key]["max_reserved"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="seed_t4,t4")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = p.parse_args(argv)
    path = outputs_dir() / "simulate" / f"grid-torch-{torch.__version__}.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    print(f"{'preset':<8} {'offload':<12} {'prec':<5} {'batch':>5} {'simulated MB':>13} {'budget MB':>10} {'ratio':>6}")
    worst = []
    for name in args.presets.split(","):
        for offload in ("async", "consolidate"):
            for precision in ("fp16", "fp32"):
                for batch in (int(b) for b in args.batches.split(",")):
                    sim = simulated_reserved(name, precision, offload, batch, cache)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_json(path, cache)
                    b = budget.predict_budget(preset(name).replace(batch_size=batch), "t4",
                                              precision=precision, offload=offload)
                    predicted = b.totals["vram"] - b.device.cuda_context_bytes
                    ratio = predicted / sim
                    worst.append(ratio)
                    flag = "" if 0.9 <= ratio <= 1.1 else "  outside 0.9-1.1"
                    print(f"{name:<8} {offload:<12} {precision:<5} {batch:>5} {sim / 1e6:>13,.0f} "
                          f"{predicted / 1e6:>10,.0f} {ratio:>6.3f}{flag}", flush=True)
    inside = sum(0.9 <= r <= 1.1 for r in worst)
    print(f"\nbudget / simulated (CUDA context excluded): {min(worst):.3f} .. {max(worst):.3f}; "
          f"{inside} of {len(worst)} within 0.9-1.1 (simulated T4, not a measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
