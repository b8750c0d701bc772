"""The training loop: resume or start, step, evaluate, save locally, back up, finish with final.pt.

`train(cache_dir, out, config)` is what `python -m nblib train` and notebook 06 run, over a task
(`nblib.train.task.ImageTask`: a cache of images with the TRM or any `model=` spec;
`nblib.train.records.RecordTask`: record shards with `fields=`). Rerunning it on the same folder resumes
from the newest state that loads and gives the same final bytes as an uninterrupted run: every input of a
step is in the state, kernels are deterministic and dropout is keyed by (seed, step, rank); how, and what
torchrun changes: docs/training.md. A non-finite loss (or weights about to be saved) stops the run with
TrainingDiverged before anything after the last good state is written.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nblib.atomic import atomic_torch_save, sha256_json
from nblib.compare import progress_bar
from nblib.disk import refuse_overlap
from nblib.errors import ConfigError, ResumeMismatch, TrainingDiverged
from nblib.manifest import write_manifest
from nblib.trm import autocast
from nblib.units import fmt_duration, fmt_rate

from .config import TrainConfig
from .data import BatchPlan, StepBatches
from .device import as_nblib_error, deterministic, dropout_seed, require_device
from .objstore import check_run_folders
from .records import RecordTask
from .state import STATE_FORMAT, capture_rng, check_identity, check_model, restore_rng, seed_everything
from .store import Durability, TrainStore
from .task import ImageTask, cross_entropy, model_config, vram_preflight

__all__ = ["TrainReport", "model_config", "train", "train_step", "training_objects"]

FINAL = "final.pt"
log = logging.getLogger("nblib.train")
SAMPLE_LOG_ENV = "NBLIB_TRAIN_SAMPLE_LOG"   # set: each rank appends "step: indices" (.txt), "step: seed" (.seeds)
REPORT = "train.json"
REPORT_KIND = "nblib.train.run"
FP16_HINT = " or --precision bf16 (fp32 on CPU)"


@dataclass
class TrainReport:
    """What a run did: steps, metric history, where it resumed from, save cost, durability."""

    out: Path
    steps: int
    start_step: int
    resumed_from: str
    history: list[dict]
    best_step: int | None
    final: Path | None
    seconds: float
    step_seconds: list[float] = field(default_factory=list)
    save_seconds: list[float] = field(default_factory=list)    # what each save blocked the loop
    save_waits: list[float] = field(default_factory=list)      # of which: waiting for the previous write
    write_seconds: list[float] = field(default_factory=list)   # each write on the writer thread (async)
    final_wait_seconds: float = 0.0                             # joining the last write before final.pt
    samples: int = 0
    durability: Durability | None = None
    classes: list[str] = field(default_factory=list)
    next_step: str = ""                                          # the command that uses final.pt
    chance: float | None = None                                  # accuracy by guessing (None: 1 / classes)
    world_size: int = 1                                          # processes (torchrun ranks) of this launch
    world_change: str | None = None                              # a resume on another number of them: the line

    @property
    def first(self) -> dict:
        return self.history[0] if self.history else {}

    @property
    def last(self) -> dict:
        return self.history[-1] if self.history else {}

    @property
    def save_share(self) -> float:
        """The loop's blocking time in saves as a share of its step time."""
        steps = sum(self.step_seconds)
        return sum(self.save_seconds) / steps if steps else 0.0

    def __str__(self) -> str:
        lines = [f"trained {self.out}: steps {self.start_step} -> {self.steps} (resumed from {self.resumed_from})"]
        if self.first and self.last:
            line = f"held-out loss {self.first['heldout_loss']:.4f} -> {self.last['heldout_loss']:.4f}"
            if self.classes and not math.isnan(self.last["heldout_accuracy"]):
                line += (f", accuracy {self.first['heldout_accuracy']:.1%} -> {self.last['heldout_accuracy']:.1%} "
                         f"(chance {self.chance or 1 / len(self.classes):.1%}, {len(self.classes)} classes)")
            lines.append(line)
        if self.save_seconds:
            step, saves = float(np.mean(self.step_seconds)) if self.step_seconds else float("nan"), self.save_seconds
            lines.append(f"saves blocked the loop {fmt_duration(sum(self.save_seconds))} = {self.save_share:.1%} of "
                         f"step time ({len(saves)} saves of {fmt_duration(np.mean(saves))} each, "
                         f"of which {fmt_duration(np.mean(self.save_waits or [0.0]))} waiting for the previous write; "
                         f"{len(self.step_seconds)} steps of {fmt_duration(step)} on average over all steps, "
                         f"{fmt_rate(self.samples / max(sum(self.step_seconds), 1e-9))})")
        if self.write_seconds:
            lines.append(f"background writes {fmt_duration(np.mean(self.write_seconds))} each; the last one joined "
                         f"in {fmt_duration(self.final_wait_seconds)} at the end")
        if self.durability is not None:
            lines.append(self.durability.line())
        if self.final is not None:
            lines.append(f"final weights: {self.final}; next: {self.next_step}")
        return "\n".join(lines)


def _open_store(out: Path, mirror, config: TrainConfig, storage_options, sync_save: bool, quota_bytes,
                startup_timeout_s: float, identity: dict, rank: int = 0):
    """(the writer rank's store or None, this rank's lock on `out`): every rank of one launch locks the run
    folder under one identity (a second run is refused before it writes); rank 0 opens the store, which
    claims the mirror (Drive folder or bucket) for this run's identity and runs its thread.
    """
    from nblib.lock import FolderLock, run_identity

    lock = FolderLock(out, identity=run_identity(f"nblib.train:{sha256_json(identity)[:16]}"), rank=rank,
                      what="run folder", hint="train into another --out").acquire()
    if rank != 0:
        return None, lock
    try:
        store = TrainStore(out, mirror, keep_last=config.keep_last, storage_options=storage_options,
                           start_mirror=True, sync_save=sync_save, quota_bytes=quota_bytes, identity=identity,
                           deadline_s=startup_timeout_s)
    except BaseException:
        lock.release()
        raise
    return store, lock


def _resume(state: dict | None, source: str, out: Path, identity: dict, plan: BatchPlan,
            objects: tuple) -> tuple[int, list, dict | None, str]:
    """Load a verified state into (model, optimizer, scheduler, scaler): its step, history, best and source."""
    if state is None:
        return 0, [], None, "start" if source == "none" else source
    where = f"{out} ({source} state, step {state['step']})"
    check_model(state["identity"], identity, where)
    check_identity(state["identity"], identity, where)
    for obj, key in zip(objects, ("model", "optimizer", "scheduler", "scaler")):
        obj.load_state_dict(state[key])
    step = plan.step_of(state["data_order"])
    if step != state["step"]:
        raise ResumeMismatch(f"the state's data order resumes at step {step} but it says step {state['step']}: "
                             f"it was edited; remove {out} or restore the file")
    return step, list(state["history"]), state["best"], source


def _close_store(store: TrainStore | None, report: TrainReport, mirror_timeout_s: float, lock) -> None:
    """Join the writer, wait (bounded) for the mirror, record what is durable in the report; release the lock."""
    try:
        if store is not None:
            report.durability = store.close(mirror_timeout_s)
            report.write_seconds = list(store.write_seconds)
    finally:
        lock.release()


def train(cache_dir: str | Path, out: str | Path, config: TrainConfig, *, mirror: str | None = None,
          texts: str | Path | None = None, progress: bool = False, world=None, storage_options: dict | None = None,
          mirror_timeout_s: float = 60.0, stop_after: int | None = None, on_step=None, sync_save: bool = False,
          mirror_quota_bytes: int | None = None, model: str | None = None, output: str | None = None,
          weights: str | Path | None = None, fields=None, val: str | Path | None = None) -> TrainReport:
    """Train (or resume) the run in `out` to `config.steps`; the report. See the module docstring.

    cache_dir: an image cache, or record shards with `fields` (`nblib.train.records.RecordFields`).
    val: an image cache of the user's own held-out images (labelled, classes named as the training cache's):
    evaluated instead of a split carved from `cache_dir`, whose images then all train.
    model: a model spec (`nblib.models.load_model`; None: the TRM, or the linear model for records);
    output: the model output its head (records: its loss) takes; weights: a state dict to start from.
    stop_after: stop (cleanly, after saving) once this step is reached (notebook demos of a resume).
    on_step(step, report): called after every step (progress displays, tests).
    sync_save: write each state on the loop's thread (default: a snapshot now, the write on a writer thread).
    mirror_quota_bytes: the mirror folder's quota (Drive) the disk watch counts against.
    torch's deterministic-algorithms switch (and cuDNN's autotuning) are this process's again on return.
    """
    device = require_device(config.device)
    with deterministic(device):
        try:
            return _train(cache_dir, out, config, mirror=mirror, progress=progress, world=world,
                          storage_options=storage_options, mirror_timeout_s=mirror_timeout_s, stop_after=stop_after,
                          on_step=on_step, sync_save=sync_save, mirror_quota_bytes=mirror_quota_bytes,
                          task_args={"texts": texts, "model": model, "output": output, "weights": weights,
                                     "fields": fields, "val": val})
        except RuntimeError as exc:
            error = as_nblib_error(exc, device)
            if error is None:
                raise
            raise error from exc


def _train(cache_dir, out, config: TrainConfig, *, mirror, progress, world, storage_options,
           mirror_timeout_s, stop_after, on_step, sync_save, mirror_quota_bytes, task_args) -> TrainReport:
    """`train` inside the deterministic switches."""
    started = time.perf_counter()
    rank, world_size = (world.rank, world.size) if world is not None else (0, 1)
    writer = rank == 0
    check_run_folders(cache_dir, out, mirror, storage_options=storage_options, timeout_s=mirror_timeout_s,
                      data_flag="--records" if task_args["fields"] is not None else "--cache")
    refuse_overlap("train", out, {"--val": task_args["val"], "--texts": task_args["texts"]}, suffix="run")
    task = make_task(cache_dir, config, **task_args)
    plan = task.plan
    plan.steps_per_epoch  # noqa: B018  refuses a batch larger than the training set, before any work
    config.micro_batch(world_size)          # refuses a batch that does not split over the ranks
    vram_preflight(task, config, world_size)    # a --model on CUDA: its traced VRAM, before anything is written
    identity = {"format": STATE_FORMAT, "config": config.computing(), **task.identity()}
    out = Path(out)
    store, lock = _open_store(out, mirror, config, storage_options, sync_save, mirror_quota_bytes,
                              mirror_timeout_s, identity, rank)
    report = TrainReport(out, config.steps, 0, "start", [], None, None, 0.0, classes=task.classes,
                         next_step=task.next_step(out / FINAL), chance=task.chance)
    model_group = None
    try:
        model = task.model.to(config.device)
        optimizer, scheduler, scaler = training_objects(model, config)
        state, source = _load(store, world)
        step, history, best, source = _resume(state, source, out, identity, plan,
                                              (model, optimizer, scheduler, scaler))
        report.start_step, report.resumed_from, report.history, report.best_step = step, source, history, best
        report.world_size, report.world_change = world_size, world_size_change(state, world_size)
        if writer and report.world_change:
            log.warning("%s", report.world_change)
        net, model_group = _wrap(model, world, config.device)
        if writer:
            store.guard(optimizer)          # async saves: CUDA moments copied in stream order (TrainStore.guard)
        if writer and step == 0:
            report.history.append(task.evaluate(model, config, 0, float("nan")))
        stop = config.steps if stop_after is None else min(config.steps, max(step, stop_after))
        batches = iter(step_loader(task.dataset, task.collate, plan, step, stop, rank, world_size, config))
        if state is not None:
            restore_rng(state["rng"])
        else:
            seed_everything(config.seed)
        state = None                        # the loaded weights were copied into the model: free them
        bar = progress_bar(config.steps, "train", "step", initial=step, disable=not (progress and writer))
        while step < stop:
            tick, fenced_before = time.perf_counter(), store.fence_seconds if writer else 0.0
            torch.manual_seed(dropout_seed(config.seed, step, rank))
            loss, seen = train_step(net, optimizer, scheduler, scaler, batches, config, task.loss)
            fenced = store.fence_seconds - fenced_before if writer else 0.0
            if fenced and report.save_seconds:
                report.save_seconds[-1] += fenced         # the save's deferred copies held this step back
            step += 1
            _check_finite(step, loss, model, config, world, out, saving=step % config.save_every == 0 or step == stop)
            if os.environ.get(SAMPLE_LOG_ENV):
                _log_samples(out, rank, step, seen)
            report.samples += config.batch_size
            report.step_seconds.append(time.perf_counter() - tick - fenced)
            if writer:
                _after_step(step, loss, model, task, config, optimizer, scheduler, scaler, identity, store, report,
                            stop)
            if not bar.disable:
                _show(bar, report, store, loss)
            if on_step is not None:
                on_step(step, report)
        bar.close()
        if writer:
            report.final_wait_seconds = store.wait_saves()      # the last state is on disk (or its error raised)
        if writer and step == config.steps:
            report.final = atomic_torch_save(task.final_payload(model, config), out / FINAL).path
    finally:
        _close_store(store, report, mirror_timeout_s, lock)
        _close_group(model_group)
    report.seconds = time.perf_counter() - started
    if writer:
        _write_report(out, report, config)
    return report


def make_task(data, config: TrainConfig, *, texts=None, model=None, output=None, weights=None, fields=None,
              val=None):
    """The task of a run: record shards when `fields` (nblib.train.records.RecordFields) are given, else images
    (a folder of the other kind is refused by its reader, naming the flag that reads it).
    """
    if fields is not None:
        if texts is not None or val is not None:
            raise ConfigError(f"{'--texts' if texts is not None else '--val'} goes with an image cache; record "
                              f"shards carry their targets (--target-key) and hold out a split of their own: drop it")
        return RecordTask(data, config, fields, model=model, output=output, weights=weights)
    return ImageTask(data, config, texts=texts, model=model, output=output, weights=weights, val=val)


def _after_step(step, loss, model, task, config, optimizer, scheduler, scaler, identity, store, report,
                stop) -> None:
    """Rank 0 after a step: evaluate, keep the best, save locally, back up."""
    final = step == config.steps or step == stop
    if step % config.eval_every == 0 or final:
        report.history.append(task.evaluate(model, config, step, loss))
    saving = step % config.save_every == 0 or final
    if not saving:
        return
    tick = time.perf_counter()
    backup = step % config.backup_every == 0 or step == config.steps
    best = None
    if _improved(report, config.best_metric):
        report.best_step = step
        best = task.final_payload(model, config)
    state = {"identity": identity, "step": step, "epoch": step // task.plan.steps_per_epoch,
             "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": capture_rng(),
             "data_order": task.plan.state_bytes(step), "history": report.history, "best": report.best_step,
             "world_size": report.world_size}
    report.save_waits.append(waited := store.save(state, step, backup=backup, best=best))
    report.save_seconds.append(time.perf_counter() - tick)
    if waited > SAVE_WAIT_NOTICE_S and sum(w > SAVE_WAIT_NOTICE_S for w in report.save_waits) == 1:
        log.warning("%s", save_wait_line(waited, store.write_seconds[-1], float(np.mean(report.step_seconds)),
                                         config.save_every))


SAVE_WAIT_NOTICE_S = 0.05     # a save that waited longer for the write before it is said, once a run


def save_wait_line(waited_s: float, write_s: float, step_s: float, save_every: int) -> str:
    """What a run says once when an asynchronous save had to wait for the previous write: saves came faster
    than the disk writes them. The interval it names lets a write of `write_s` end within the steps between saves.
    """
    every = max(save_every + 1, math.ceil(write_s / max(step_s, 1e-9)))
    return (f"a save waited {fmt_duration(waited_s)} for the previous write: a write takes {fmt_duration(write_s)}, "
            f"{save_every} steps {fmt_duration(save_every * step_s)}; save every {every} steps or more "
            f"(--save-every {every}, TrainConfig.save_every) and the loop does not wait")


def world_size_change(state: dict | None, world_size: int) -> str | None:
    """The line a resume on another number of processes than the state's run says (None: the same, a fresh run,
    or a state saved before runs recorded theirs): the gradients are summed over other ranks, so the steps
    after it differ in their last bits from either uninterrupted run's.
    """
    saved = None if state is None else state.get("world_size")
    if saved is None or int(saved) == world_size:
        return None
    return (f"world size {int(saved)} -> {world_size}: the result will not be bit-identical to either "
            f"uninterrupted run (the state's steps ran on {int(saved)} processes, the rest run on {world_size}); "
            f"resume on {int(saved)} processes for the bytes of a {int(saved)}-process run")


def _write_report(out: Path, report: TrainReport, config: TrainConfig) -> None:
    body = {"steps": report.steps, "start_step": report.start_step, "resumed_from": report.resumed_from,
            "history": report.history, "best_step": report.best_step, "classes": report.classes,
            "config": config.to_dict(), "final": None if report.final is None else report.final.name,
            "durability": None if report.durability is None else report.durability.line(),
            "save_share": report.save_share, "world_size": report.world_size,
            "world_size_change": report.world_change}
    write_manifest(out / REPORT, REPORT_KIND, body)


def training_objects(model, config: TrainConfig):
    """(AdamW over the model's trained parameters, the LR schedule, the GradScaler): with the model, what a
    step updates. `train` and the simulated T4 (nblib.simulate.train) both build them here.
    """
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(config.warmup_steps, config.steps))
    device_type = "cuda" if config.device.startswith("cuda") else "cpu"
    scaler = torch.amp.GradScaler(device_type, enabled=config.precision == "fp16")
    return optimizer, scheduler, scaler


def train_step(net, optimizer, scheduler, scaler, batches, config, loss_fn=None) -> tuple[float, list[int]]:
    """One optimizer step over `accumulation` micro-batches; the mean loss and the sample indices read.

    A micro-batch is (tensors..., indices); `loss_fn(net, *tensors)` is its loss (default: the cross
    entropy of net(images) and the labels). The forward runs under autocast, backward outside it
    (torch's AMP recipe). A step the GradScaler skips (inf/nan gradients: it lowers its scale and
    leaves the weights) does not advance the LR schedule. `train` and the simulated T4
    (nblib.simulate.train) both run it.
    """
    total, seen = 0.0, []
    for k in range(config.accumulation):
        *tensors, indices = next(batches)
        seen += indices.tolist()
        tensors = [t.to(config.device, non_blocking=True) for t in tensors]  # from pinned memory on CUDA: async
        sync = k == config.accumulation - 1 or not hasattr(net, "no_sync")
        with contextlib.nullcontext() if sync else net.no_sync():
            with autocast(config.precision, config.device):
                loss = (loss_fn or cross_entropy)(net, *tensors) / config.accumulation
            scaler.scale(loss).backward()
        total += float(loss.detach())
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if scale is None or not scaler.get_scale() < scale:         # update() lowers the scale after a skipped step
        scheduler.step()
    return total, seen


def _check_finite(step: int, loss: float, model, config, world, out: Path, *, saving: bool) -> None:
    """TrainingDiverged on every rank when a rank's loss, or (before a save) the weights, are not finite."""
    bad = not math.isfinite(loss)
    if world is not None and world.size > 1:
        import torch.distributed as dist

        flag = torch.tensor([float(bad)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world.group)   # every rank stops, none waits
        bad = bool(flag.item())
    what = f"the training loss is {loss}" if bad else ""
    if not bad and saving:
        with torch.no_grad():
            finite = torch.stack([p.isfinite().all() for p in model.parameters()]).all()
        what = "" if bool(finite) else "the weights hold inf or nan"
    if what:
        raise TrainingDiverged(
            f"step {step}: {what} (lr {config.lr:g}, precision {config.precision}): the run diverged and nothing "
            f"from this step on is saved; {out} keeps the states saved before it. Train into another --out with a "
            f"lower --lr (the default is {TrainConfig.lr:g}){FP16_HINT * (config.precision == 'fp16')}")


def _log_samples(out: Path, rank: int, step: int, seen: list[int]) -> None:
    """The audit trail of what each rank read (tests count it: no sample skipped or repeated)."""
    folder = out / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{rank}-pid{os.getpid()}.txt", "a") as f:
        f.write(f"{step}: {' '.join(map(str, seen))}\n")
    with open(folder / f"rank{rank}-pid{os.getpid()}.seeds", "a") as f:   # the seed dropout drew from
        f.write(f"{step}: {torch.initial_seed()}\n")


def _improved(report: TrainReport, metric: str) -> bool:
    """True when the newest evaluation is the best so far by `metric` (and came at this step)."""
    scored = [h for h in report.history if h["step"] > 0]
    if not scored:
        return False
    sign = -1 if metric == "heldout_loss" else 1
    best = max(scored, key=lambda h: (sign * h[metric], -h["step"]))
    return best is scored[-1] and best["step"] != report.best_step


def _load(store, world):
    """Rank 0 loads the newest state and hands it to the other ranks (one reader, the same state)."""
    state, source = store.load_latest() if store is not None else (None, "none")
    if world is not None and world.size > 1:
        import torch.distributed as dist

        box = [(state, source)]
        dist.broadcast_object_list(box, src=0)
        state, source = box[0]
    return state, source


def _wrap(model, world, device: str):
    """(the module a step runs, the process group made for it or None): on CUDA the gradients go over a new
    nccl group (gloo would copy every bucket through host memory), `world.group` (gloo) keeps the control messages.
    """
    if world is None or world.size == 1:
        return model, None
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not device.startswith("cuda"):
        return DistributedDataParallel(model, process_group=world.group), None
    index = next(model.parameters()).device.index
    index = torch.cuda.current_device() if index is None else index
    group = dist.new_group(backend="nccl")          # collective: every rank creates it, in the same order
    return DistributedDataParallel(model, device_ids=[index], output_device=index, process_group=group), group


def _close_group(group) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group(group)


def step_loader(dataset, collate, plan, start, stop, rank, world_size, config):
    """The DataLoader of this rank's micro-batches of steps [start, stop); pinned batches on CUDA; workers that
    never fork a thread.
    """
    from torch.utils.data import DataLoader

    batches = StepBatches(plan, start, stop, rank, world_size, config.accumulation)
    return DataLoader(dataset, batch_sampler=batches, num_workers=config.workers, collate_fn=collate,
                      generator=torch.Generator().manual_seed(config.seed), pin_memory=config.device.startswith("cuda"),
                      multiprocessing_context=worker_start_method() if config.workers else None)


def worker_start_method() -> str:
    """fork while this process has one thread, forkserver once others run (a forked child gets their locks
    held, and can hang on them); the batches are the same bytes either way (docs/training.md). A main module
    with no file to import (a script read from stdin) keeps fork.
    """
    import sys
    import threading

    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if threading.active_count() == 1 or (main is not None and not os.path.isfile(main)):
        return "fork"
    return "forkserver"


def _warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _show(bar, report: TrainReport, store, loss: float) -> None:
    recent = report.step_seconds[-20:]
    per_step = report.samples / max(1, len(report.step_seconds))
    rate = len(recent) * per_step / max(sum(recent), 1e-9)
    status = store.mirror_status() if store is not None else None
    lag = "-" if status is None or store.mirror_label is None else f"{status.items_pending} pending"
    bar.set_postfix_str(f"loss {loss:.3f}  {fmt_rate(rate)} (last {len(recent)} steps)  mirror {lag}",
                        refresh=False)
    bar.update(1)
