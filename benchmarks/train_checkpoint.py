"""Saving a train state: nblib's atomic writer + manifest record against torch.distributed.checkpoint.

For the smoke and t4 encoders + head with AdamW state, three ways side by side, each repeated:
  nblib:     torch.save to memory, AtomicWriter (temporary, fsync, rename, fsync folder), record last
  dcp:       torch.distributed.checkpoint.save to a folder (FileSystemWriter: one file per rank + .metadata)
  dcp-async: torch.distributed.checkpoint.async_save: the loop blocks only for the staging copy
Prints save time, blocking time (what the training loop waits), bytes on disk, and the ratio to nblib.
Run: python benchmarks/train_checkpoint.py [--profile smoke|t4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="smoke")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    state = make_state(args.profile)
    folder = Path(tempfile.mkdtemp(prefix="nblib-ckpt-bench-"))
    try:
        rows = {name: [] for name in ("nblib", "dcp", "dcp-async")}
        for r in range(args.repeats):                          # interleaved: load drifts hit all alike
            for name, fn in (("nblib", save_nblib), ("dcp", save_dcp), ("dcp-async", save_dcp_async)):
                rows[name].append(fn(state, folder / f"{name}-{r}"))
        base = statistics.median(t for t, _, _ in rows["nblib"])
        print(f"train state of profile {args.profile}: {sum(v.numel() for v in state['model'].values()):,} "
              f"parameters; median of {args.repeats} interleaved repeats")
        print(f"{'writer':<10}{'save s':>9}{'blocking s':>12}{'bytes':>12}{'blocking / nblib':>18}")
        for name, values in rows.items():
            save = statistics.median(v[0] for v in values)
            block = statistics.median(v[1] for v in values)
            print(f"{name:<10}{save:>9.4f}{block:>12.4f}{values[0][2]:>12,}{block / base:>18.2f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


def save_nblib(state: dict, folder: Path) -> tuple[float, float, int]:
    from nblib.store.checkpoints import CheckpointFolder

    start = time.perf_counter()
    path = CheckpointFolder(folder).save(state, "state", 1)
    took = time.perf_counter() - start
    return took, took, path.stat().st_size + (folder / "state-000001.json").stat().st_size


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


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


if __name__ == "__main__":
    main()
