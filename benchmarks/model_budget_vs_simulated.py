"""The traced VRAM budget (nblib.budget.model_vram) against the simulated jobs (nblib.simulate.model), per model.

Prints, for each model, job (encode / train) and precision, at batch 8, 64 and the largest that fits:
budget reserved / simulated reserved (CUDA context excluded from both), and the seconds each took.
Every figure is simulated on a CPU (FakeTensorMode): run `python benchmarks/model_budget_vs_simulated.py`
(add `--quick` for the TRM and ViT-B/16 only).
"""
from __future__ import annotations

import sys
import time

MODELS = ("trm", "hf:ViTModel", "hf:ResNetModel", "hf:ConvNextModel", "hf:CLIPVisionModel")


def main(argv: list[str]) -> int:
    from nblib.budget.model_vram import model_vram
    from nblib.simulate.model import simulate_model

    models = MODELS[:2] if "--quick" in argv else MODELS
    print(f"{'model':<20}{'job':<8}{'prec':<6}{'batch':>6}{'budget GB':>11}{'sim GB':>9}{'ratio':>7}"
          f"{'budget s':>10}{'sim s':>8}  largest")
    for spec in models:
        for train in (False, True):
            for precision in ("fp16", "fp32"):
                t = time.perf_counter()
                first = model_vram(spec, 8, precision=precision, train=train)
                first_s = time.perf_counter() - t       # batch 8's budget, with the search for the largest
                largest = first.largest_batch or 8
                for batch in sorted({8, 64, largest}):
                    t = time.perf_counter()
                    budget = first if batch == 8 else model_vram(spec, batch, precision=precision, train=train,
                                                                 find_largest=False)
                    tb = first_s if batch == 8 else time.perf_counter() - t
                    t = time.perf_counter()
                    sim = simulate_model(spec, batch, precision=precision, train=train)
                    ts = time.perf_counter() - t
                    print(f"{spec:<20}{'train' if train else 'encode':<8}{precision:<6}{batch:>6}"
                          f"{budget.reserved / 1e9:>11.3f}{sim.max_reserved / 1e9:>9.3f}"
                          f"{budget.reserved / sim.max_reserved:>7.3f}{tb:>10.1f}{ts:>8.1f}  {largest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
