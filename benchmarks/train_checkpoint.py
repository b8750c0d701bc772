"""Saving a train state: nblib's atomic writer + record, synchronous and asynchronous, against
torch.distributed.checkpoint (DCP), synchronous and asynchronous.

For the smoke and t4 encoders + head with AdamW state, four ways side by side, interleaved repeats:
  nblib-sync:  TrainStore(sync_save=True).save: torch.save to memory, AtomicWriter (temporary, fsync,
               rename, fsync folder), record last, on the training thread (the writer before async saves)
  nblib-async: TrainStore.save: the loop blocks for the snapshot (a host copy of the tensors); the same
               write runs on the store's writer thread; save time is until `wait_saves` returns
  dcp:         torch.distributed.checkpoint.save to a folder (FileSystemWriter: one file per rank + .metadata)
  dcp-async:   torch.distributed.checkpoint.async_save: the loop blocks for DCP's staging copy
Prints save time, blocking time (what the training loop waits), bytes on disk (min / median / max of
the repeats), the blocking time against nblib-sync, and, with --step-seconds S (a measured step time,
e.g. from `python -m nblib train ... --steps 40`'s report), the blocking time as a share of a step and
of a save interval of --save-every steps.
Run: python benchmarks/train_checkpoint.py [--profile smoke|t4] [--repeats 5] [--step-seconds S]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

WRITERS = ("nblib-sync", "nblib-async", "dcp", "dcp-async")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="smoke")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-seconds", type=float, help="a measured training step of this profile, seconds")
    p.add_argument("--save-every", type=int, default=5, help="steps per local save (train's default 5)")
    args = p.parse_args()
    state = make_state(args.profile)
    folder = Path(tempfile.mkdtemp(prefix="nblib-ckpt-bench-"))
    try:
        savers = {"nblib-sync": save_nblib_sync, "nblib-async": save_nblib_async, "dcp": save_dcp,
                  "dcp-async": save_dcp_async}
        rows = {name: [] for name in WRITERS}
        for r in range(args.repeats):                          # interleaved: load drifts hit all alike
            for name in WRITERS:
                rows[name].append(savers[name](state, folder / f"{name}-{r}"))
                shutil.rmtree(folder / f"{name}-{r}", ignore_errors=True)
        print(f"train state of profile {args.profile}: {sum(v.numel() for v in state['model'].values()):,} "
              f"parameters; min / median / max of {args.repeats} interleaved repeats")
        print(table(rows, args.step_seconds, args.save_every))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(rows: dict, step_seconds: float | None, save_every: int) -> str:
    """One line per writer: save s, blocking s (min / median / max), bytes, blocking vs nblib-sync, share of a step."""
    base = statistics.median(v[1] for v in rows["nblib-sync"])
    head = f"{'writer':<12}{'save s':>24}{'blocking s':>24}{'bytes':>14}{'block/sync':>12}"
    if step_seconds:
        head += f"{'block/step':>12}{f'/{save_every} steps':>12}"
    lines = [head]
    for name, values in rows.items():
        block = statistics.median(v[1] for v in values)
        line = (f"{name:<12}{_spread([v[0] for v in values]):>24}{_spread([v[1] for v in values]):>24}"
                f"{values[0][2]:>14,}{block / base:>12.3f}")
        if step_seconds:
            line += f"{block / step_seconds:>12.1%}{block / (save_every * step_seconds):>12.1%}"
        lines.append(line)
    return "\n".join(lines)


def make_state(profile: str) -> dict:
    from nblib.train.loop import model_config
    from nblib.train.model import Classifier

    model = Classifier(model_config(profile).model, 12)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    images = torch.randint(0, 256, (2, model.encoder.config.image_size, model.encoder.config.image_size, 3),
                           dtype=torch.uint8)
    torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1])).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def save_nblib_sync(state: dict, folder: Path) -> tuple[float, float, int]:
    from nblib.train.store import TrainStore

    store = TrainStore(folder, sync_save=True)
    start = time.perf_counter()
    store.save(state, 1, backup=False)
    took = time.perf_counter() - start
    store.close()
    return took, took, _size(folder / "checkpoints")


def save_nblib_async(state: dict, folder: Path) -> tuple[float, float, int]:
    from nblib.train.store import TrainStore

    store = TrainStore(folder)
    start = time.perf_counter()
    store.save(state, 1, backup=False)
    blocking = time.perf_counter() - start
    store.wait_saves()
    took = time.perf_counter() - start
    store.close()
    return took, blocking, _size(folder / "checkpoints")


def save_dcp(state: dict, folder: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder))
    took = time.perf_counter() - start
    return took, took, _size(folder)


def save_dcp_async(state: dict, folder: Path) -> tuple[float, float, int]:
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(folder))
    blocking = time.perf_counter() - start
    future.result()
    return time.perf_counter() - start, blocking, _size(folder)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}/{statistics.median(values):.3f}/{max(values):.3f}"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


if __name__ == "__main__":
    main()
