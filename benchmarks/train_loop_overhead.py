"""The training loop's own cost: `nblib.train.train` against a plain PyTorch loop of the same model, batch, data and
precision, interleaved (issue 51).

    OMP_NUM_THREADS=1 python benchmarks/train_loop_overhead.py [--repeats 5] [--steps 24] [--batch-size 16]

Both sides train the smoke TRM classifier `train` builds (`ImageTask`'s model: the encoder + BatchNorm, dropout
and a linear head, seed 0) in fp32 on the CPU, batch `--batch-size`, on a generated labelled 64 px cache of the
first `--images` sample texts, one DataLoader with no workers each:
  plain        the loop a user writes: DataLoader(shuffle=True, drop_last=True) over the cache's images and labels,
               forward, F.cross_entropy, backward, AdamW (the run's lr and weight decay), zero_grad
  plain+det    the same under the determinism settings `train` sets (torch.use_deterministic_algorithms(True),
               cudnn.benchmark off) and with `train`'s per-step reseed of dropout's generator
  nblib        `train` with checkpoints and evaluation as rare as it allows (the last step's save and evaluation,
               outside the timed steps)
  nblib-ckpt   the same with `--save-every` (async saves: a snapshot on the loop, the write on a writer thread)
  nblib-nodet  `nblib` with `deterministic` (the switches) replaced by a no-op: what the switches cost `train`
Steps/s: the steps after `--warmup` to the one before the last (so the last step's save and evaluation are out),
timed from on_step callbacks (nblib) or the loop (plain); the median of the repeats, run interleaved in a rotated
order so a busy machine's noise hits every variant alike. The per-step checks are then timed line by line on the
run's own objects (timeit, microseconds per step) against a plain step.
Prints the table and the load, and writes benchmarks/results/train_loop_overhead.json. Goal: nblib >= 0.9x plain.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

from nblib.train import TrainConfig, loop
from nblib.train.device import deterministic, dropout_seed
from nblib.train.loop import make_task

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.sample_cache import labelled_cache  # noqa: E402  the train tests' labelled cache of the sample texts

NEVER = 10 ** 6                      # save_every / eval_every no timed step reaches


class Images(torch.utils.data.Dataset):
    """The cache's images and labels, as a user's own Dataset reads them (item: uint8 [H, W, 3], label)."""

    def __init__(self, task):
        self.cache, self.labels, self.index = task.cache, task.labels, task.train_idx

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        j = int(self.index[i])
        return torch.from_numpy(self.cache[j]), int(self.labels[j])


def plain(cache: Path, config: TrainConfig, steps: int, warmup: int, det: bool) -> float:
    """Steps/s of the plain loop (with `det`: under train's determinism switches and its per-step reseed)."""
    task = make_task(cache, config)
    model = task.model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    data = torch.utils.data.DataLoader(Images(task), batch_size=config.batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(0))
    batches = (b for _ in range(steps) for b in data)
    with deterministic("cpu") if det else contextlib.nullcontext():
        for step in range(steps - 1):
            if step == warmup:
                started = time.perf_counter()
            if det:
                torch.manual_seed(dropout_seed(config.seed, step, 0))
            images, labels = next(batches)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            float(loss.detach())
    return (steps - 1 - warmup) / (time.perf_counter() - started)


def nblib(cache: Path, out: Path, config: TrainConfig, steps: int, warmup: int, save_every: int,
          det: bool = True) -> float:
    """Steps/s of `train` over steps warmup+1 .. steps-1 (the last step's save and evaluation left out)."""
    ticks = {}

    def on_step(step, report):
        ticks[step] = time.perf_counter()

    run = config.replace(steps=steps, save_every=save_every, backup_every=save_every, eval_every=NEVER)
    switches = loop.deterministic
    loop.deterministic = switches if det else lambda device: contextlib.nullcontext()
    try:
        loop.train(cache, out, run, on_step=on_step)
    finally:
        loop.deterministic = switches
    return (steps - 1 - warmup) / (ticks[steps - 1] - ticks[warmup])


def line_costs(cache: Path, config: TrainConfig, out: Path) -> dict[str, float]:
    """Microseconds per step of each per-step line `train` runs beyond a plain step, timed on the run's objects."""
    task = make_task(cache, config)
    model = task.model
    loss, number = 2.3, 2000
    indices = torch.arange(config.batch_size)
    lines = {
        "torch.manual_seed(dropout_seed(seed, step, rank))  (dropout's stream per step)":
            lambda: torch.manual_seed(dropout_seed(config.seed, 7, 0)),
        "_check_finite(loss) on a step without a save  (math.isfinite of the loss)":
            lambda: loop._check_finite(7, loss, model, config, None, out, saving=False),
        "_check_finite(weights) on a save step  (isfinite of every parameter)":
            lambda: loop._check_finite(8, loss, model, config, None, out, saving=True),
        "seen += indices.tolist()  (the samples a step read)": lambda: indices.tolist(),
        "os.environ.get(SAMPLE_LOG_ENV)  (the audit trail switch)": lambda: os.environ.get(loop.SAMPLE_LOG_ENV),
        "StepBatches: plan.rank_batch(step)  (the global shuffle's batch indices)":
            lambda: task.plan.rank_batch(7, 0, 1),
    }
    return {name: 1e6 * timeit.timeit(fn, number=number) / number for name, fn in lines.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--images", type=int, default=240)
    p.add_argument("--save-every", type=int, default=5, help="nblib-ckpt's checkpoint interval (train's default)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    config = TrainConfig(batch_size=args.batch_size, precision="fp32", device="cpu", workers=0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = labelled_cache(root / "data", args.images)
        s, w = args.steps, args.warmup
        variants = {
            "plain": lambda k: plain(cache, config, s, w, det=False),
            "plain+det": lambda k: plain(cache, config, s, w, det=True),
            "nblib": lambda k: nblib(cache, root / f"off{k}", config, s, w, NEVER),
            "nblib-ckpt": lambda k: nblib(cache, root / f"ckpt{k}", config, s, w, args.save_every),
            "nblib-nodet": lambda k: nblib(cache, root / f"nodet{k}", config, s, w, NEVER, det=False),
        }
        rates = {name: [] for name in variants}
        names = list(variants)
        for k in range(args.repeats):
            for name in names[k % len(names):] + names[:k % len(names)]:      # rotated: no variant always first
                rates[name].append(variants[name](k))
        lines = line_costs(cache, config, root / "lines")
    report(rates, lines, args)


def report(rates: dict, lines: dict, args) -> None:
    med = {name: statistics.median(r) for name, r in rates.items()}
    best = {name: max(r) for name, r in rates.items()}
    paired = {name: statistics.median(a / b for a, b in zip(r, rates["plain"])) for name, r in rates.items()}
    base = med["plain"]
    step_us = 1e6 / best["plain"]
    print(f"train loop overhead: smoke TRM classifier, fp32 CPU, batch {args.batch_size}, {args.steps} steps "
          f"({args.steps - 1 - args.warmup} timed), {args.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} torch thread(s); load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'variant':<12} {'steps/s median':>15} {'best':>8} {'min':>8} {'x plain paired':>15} {'best/best':>10}")
    for name, r in rates.items():
        print(f"{name:<12} {med[name]:>15.2f} {best[name]:>8.2f} {min(r):>8.2f} {paired[name]:>15.3f} "
              f"{best[name] / best['plain']:>10.3f}")
    print("x plain paired: the median over repeats of this variant's steps/s over plain's in the same round")
    ckpt = (1 / paired["nblib-ckpt"] - 1 / paired["nblib"]) * args.save_every / base
    print(f"checkpoints: every {args.save_every} steps cost {ckpt * 1e3:,.1f} ms per save on the loop "
          f"({paired['nblib-ckpt'] / paired['nblib']:.3f}x nblib's steps/s; from the paired ratios and plain's "
          f"median step)")
    print(f"determinism settings: plain+det / plain {paired['plain+det']:.3f}x (paired); nblib / nblib-nodet "
          f"{paired['nblib'] / paired['nblib-nodet']:.3f}x")
    print(f"per-step lines of train beyond a plain step (a plain step is {step_us / 1e3:,.1f} ms):")
    for name, us in lines.items():
        print(f"  {us:>9.1f} us  {us / step_us:>7.3%}  {name}")
    body = {"command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python "
                       f"benchmarks/train_loop_overhead.py --repeats {args.repeats} --steps {args.steps} "
                       f"--batch-size {args.batch_size}",
            "load": os.getloadavg(), "torch_threads": torch.get_num_threads(), "args": vars(args),
            "steps_per_s": rates, "median_steps_per_s": med, "best_steps_per_s": best, "x_plain_paired": paired,
            "save_ms_on_loop": ckpt * 1e3, "line_us_per_step": lines, "plain_step_us": step_us,
            "goal": "nblib >= 0.9x plain", "met": paired["nblib"] >= 0.9 and not math.isnan(base)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_loop_overhead.json").write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {RESULTS / 'train_loop_overhead.json'}")


if __name__ == "__main__":
    main()
