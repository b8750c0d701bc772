"""The training budget's VRAM against the simulated T4's training step, on a grid.

    PYTHONPATH=. python benchmarks/train_budget_vs_simulated.py                 # the grid (~3 min on 2 busy cores)
    PYTHONPATH=. python benchmarks/train_budget_vs_simulated.py --presets t4 --batches 8,32,64 --lines

Each row: `nblib.simulate.train.simulate_train_step` (the loop's own train_step, three steps, on a
fake T4: forward, backward, GradScaler, AdamW) gives the simulated max_memory_allocated and
max_memory_reserved; `nblib.budget.training.predict_training(..., device="cuda")` without the
runtime line gives the budget; the ratio is budget / simulated reserved. `--lines` prints the
budget's lines beside the simulation's resident bytes. Every figure is simulated; none is measured
on a GPU, and neither side holds the CUDA context.
"""
from __future__ import annotations

import argparse
import sys

from nblib.lab.training import simulated_t4_rows
from nblib.train.loop import model_config

BATCHES = {"smoke": (32, 256, 1024), "t4": (8, 32, 64)}
TOLERANCE = 0.10


def row(name: str, precision: str, batch: int) -> dict:
    """One grid point: notebook 06's row (budget, simulated allocated / reserved, ratio) for a preset."""
    return {"preset": name, **simulated_t4_rows(model_config(name).model, (batch,), precision)[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="smoke,t4")
    p.add_argument("--precisions", default="fp32,fp16")
    p.add_argument("--batches", default="", help="comma-separated; default per preset")
    p.add_argument("--lines", action="store_true", help="print the budget's lines under each row")
    args = p.parse_args(argv)
    mb = 1e6
    print(f"{'preset':<7}{'prec':<6}{'batch':>6}{'budget MB':>11}{'sim alloc MB':>14}{'sim reserved MB':>17}"
          f"{'budget/reserved':>17}{'roofline ms':>13}  peak op (simulated)")
    outside = 0
    for name in args.presets.split(","):
        batches = [int(x) for x in args.batches.split(",")] if args.batches else BATCHES[name]
        for precision in args.precisions.split(","):
            for batch in batches:
                r = row(name, precision, batch)
                flag = "" if abs(r["ratio"] - 1) <= TOLERANCE else "   <- outside +-10%"
                outside += bool(flag)
                print(f"{name:<7}{precision:<6}{batch:>6}{r['budget'] / mb:>11.1f}{r['allocated'] / mb:>14.1f}"
                      f"{r['reserved'] / mb:>17.1f}{r['ratio']:>17.3f}{r['step_s'] * 1e3:>13.2f}  {r['peak_op']}{flag}",
                      flush=True)
                if args.lines:
                    for line in r["lines"]:
                        print(f"{'':>13}{line.name:<34}{line.bytes / mb:>10.1f} MB")
                    print(f"{'':>13}{'simulated resident between steps':<34}{r['resident'] / mb:>10.1f} MB")
    print(f"\nrows outside +-{TOLERANCE:.0%}: {outside} (all figures simulated on a fake T4, no CUDA context)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
