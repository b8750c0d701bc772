"""The streaming, resumable encode run: its plan, manifest, resume checks, preflight and progress.

Batches are fixed (batch i = samples [i*B, (i+1)*B)) and grouped into parts of `checkpoint_every`
batches. Each part is written through a `PartStore` (local first, mirrored to Drive), then the
run manifest records the parts, the samples done and fingerprints of the settings, the weights
and the cache. A rerun encodes only the parts that are not durable, and refuses when a
fingerprint changed rather than mixing outputs. Same batches and threads give the same bytes, so
a resumed run equals an uninterrupted one. Trade-off: a kill loses at most one part of work;
smaller parts lose less but write more files. A run holds its folder's lock (`nblib.lock`), so a
second run on the same --out is refused instead of mixing parts. torch is imported when a run
starts, not here.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nblib import budget
from nblib.atomic import sha256_json
from nblib.cache import ShardedImageCache
from nblib.cache.format import DAMAGED, WHY_DAMAGED, damaged_error, shard_state
from nblib.config import PipelineConfig
from nblib.encode import numerics
from nblib.encode.consolidate import consolidate
from nblib.encode.disks import DISK_BLOCK, check_disks, disk_needs, on_mirror
from nblib.encode.distributed import SINGLE, World
from nblib.encode.layout import (
    RUN_KIND,
    RUN_VERSION,
    RunPlan,
    is_run_part,
    open_store,
    part_meta,
    part_name,
    plan_run,
    read_run_manifest,
    refuse_if_changed,
    settings_of,
)
from nblib.encode.model import EncodeModel, encode_model
from nblib.encode.protocols import ImageSource, PartStore, require_image_source, require_part_store
from nblib.encode.ranks import RankRecord, require_all_parts
from nblib.env import Workspace
from nblib.errors import BudgetExceeded, CacheError, ConfigError, StateError, require_choice
from nblib.lock import FolderLock, run_identity
from nblib.malloc import pin_malloc_mmap_threshold
from nblib.store.parts import VerifyLevel
from nblib.units import fmt_duration, fmt_exception

__all__ = [
    "DISK_BLOCK", "OFFLOAD_MODES", "Consolidated", "EncodeReport", "EncodedParts", "RunInputs",
    "VerifiedShards", "check_disks", "consolidate_run", "disk_needs", "encode", "encode_parts",
    "pending_parts", "plan_encode", "resolve_device", "resume", "run_lock",
]

log = logging.getLogger(__name__)

OFFLOAD_MODES = ("async", "consolidate")


# ------------------------------------------------------------------------------ encode


@dataclass(frozen=True)
class EncodeReport:
    """What one call of `encode` did: samples, parts, where it resumed, speed, and the outputs."""

    run_dir: Path
    n_samples: int
    parts_total: int
    parts_encoded: int
    resumed_at: int
    seconds: float
    samples_per_s: float
    offload: str
    device: str
    timeline: tuple[tuple[float, int], ...]  # (seconds since start, samples encoded), per batch
    outputs: dict[str, Path]                 # consolidated arrays (empty when not consolidated)
    mirror_caught_up: bool | None = None     # None without a mirror; False: parts wait locally
    write_seconds: float = 0.0               # of `seconds`: writing parts and the manifest

    def __str__(self) -> str:
        resumed = f", resumed at sample {self.resumed_at:,}" if self.resumed_at else ""
        if self.parts_encoded == 0 and self.parts_total:      # a rerun of a finished run: nothing to encode
            lines = [f"already complete: {self.parts_total} of {self.parts_total} parts ({self.n_samples:,} samples) "
                     f"were encoded before (here or in the mirror); nothing to encode"]
        else:
            lines = [f"encoded {self.parts_encoded} of {self.parts_total} parts "
                     f"({self.n_samples:,} samples{resumed}) on {self.device} in {fmt_duration(self.seconds)}, "
                     f"{self.samples_per_s:,.1f} samples/s, offload={self.offload}"]
        if self.mirror_caught_up is False:
            lines.append("  the mirror is behind: every part is safe locally; rerun to catch it up")
        lines += [f"  {name:<9} {path}" for name, path in self.outputs.items()]
        return "\n".join(lines)


def encode(cache: ImageSource, run_dir: str | Path, config: PipelineConfig, device: str | None = None, *,
           outputs: tuple[str, ...] | None = None, out_dtype: str | None = None,
           mirror_dir: str | Path | None = None, progress: bool = True, offload: str = "async",
           weights: str | Path | None = None, model=None, preflight: bool = True, workspace=None,
           do_consolidate: bool = True, store: PartStore | None = None,
           world: World | None = None, verify: VerifyLevel = VerifyLevel.STAT, precision: str = "auto",
           reencode_numerics: bool = False) -> EncodeReport:
    """Encode every image of `cache` into parts under `run_dir`, resuming what is durable.

    The run goes through five phases, each a function of plain values: `plan_encode` (check the
    inputs, load the encoder, fingerprint), `resume` (read the run manifest once, list the durable
    parts), `World.assign` (this process's share), `encode_parts` (encode and write them) and
    `consolidate_run` (merge, recomputing parts found damaged). The run holds the run folder's
    lock (`run_lock`) throughout: a second run on it gets FolderBusyError.

    Args:
        cache: the images (`ImageSource`: a `ShardedImageCache`, or any object with its members).
        run_dir: the run folder (--out): parts under run_dir/parts, consolidated outputs in it.
        config: the pipeline config (model, batch size, checkpoint cadence, outputs, dtype, seed).
        device: "cpu", "cuda" or "cuda:N"; None: cuda when available.
        outputs, out_dtype: override the config's outputs and their dtype.
        mirror_dir: a second folder (Drive) every part is mirrored to in a thread (one process only).
        progress: show a progress bar.
        offload: "async" (per-batch copies to pinned host buffers) or "consolidate" (keep
            `consolidate_every` batches on the GPU, then one copy).
        weights: a state dict (safetensors or torch) loaded strictly over the model's seeded weights.
        model: a spec (`nblib.models.SOURCES`: "trm", "hf:CLASS", ...), a
            `LoadedModel` or an nn.Module (None: the TRM); it stores `outputs` (default: all).
        preflight: check RAM, VRAM and each disk against the budget before the first batch.
        workspace: the `nblib.env.Workspace` the preflight checks (default: run_dir everywhere).
        do_consolidate: merge the parts into one .npy per output at the end.
        store: a `PartStore` to write through, used as it is and left open (default: one opened
            on run_dir/parts and closed).
        world: this process's role (`nblib.encode.distributed.join()`): a rank or shard encodes
            its share of the parts, and only the consolidating one merges them.
        verify: how a resume checks the durable parts: `VerifyLevel.STAT` (part.json, sizes,
            stat; a file whose stat changed is hashed), `VerifyLevel.HASH` (every part hashed
            first, and every consolidated output: a damaged one is rebuilt) or `VerifyLevel.SIZES`.
        precision: the encoder's: "auto" (fp16 autocast on CUDA, fp32 on CPU), "fp32", "fp16", "bf16".
        reencode_numerics: on a resume with another device, precision or torch/CUDA version
            (`nblib.encode.numerics`), encode the parts made with the other numerics again
            (default: refuse, naming the change).

    Returns:
        An `EncodeReport`: samples, parts encoded, where it resumed, speed, the output paths.

    Raises:
        ConfigError, CacheError, BudgetExceeded, ResumeMismatch, FolderBusyError, StateError
        (each names the cause and the fix).
    """
    world = world if world is not None else SINGLE
    run = plan_encode(cache, run_dir, config, device, outputs=outputs, out_dtype=out_dtype,
                      mirror_dir=mirror_dir, offload=offload, weights=weights, model=model, world=world,
                      precision=precision, reencode_numerics=reencode_numerics)
    identity = numerics.identity_of(run.fingerprints)          # a resume on other hardware is the same run
    with run_lock(run.run_dir, identity, world.rank, world.lock_environ) as lock:  # another run: refused
        parts_store = open_store(run.run_dir, run.mirror_dir, identity) if store is None \
            else require_part_store(store)
        manifest = resume(parts_store, run, world, VerifyLevel.of(verify))
        pending = pending_parts(run.plan, manifest)
        mine = world.assign(pending, run.plan.n_parts, run.fingerprints)    # this process's share
        if mine and preflight:
            _preflight(run, workspace, pending, do_consolidate, world)
        with world.progress(run.run_dir, run.plan.n_parts, progress):      # one bar over all ranks' parts
            done = encode_parts(run, parts_store, manifest, mine, lock, world.record(run.run_dir, mine),
                                write_manifest=world.writes_manifest, progress=progress and not world.distributed)
        world.barrier("the end, once every rank has written its parts")
        merged = consolidate_run(run, parts_store, done.manifest, lock, world, VerifyLevel.of(verify)) \
            if do_consolidate and world.consolidates else Consolidated({}, ())
        mirrored = parts_store.close() if store is None else None   # waits for the mirror; warns if failing
    encoded = (len(pending) if world.role == "rank" else len(mine)) + len(merged.recomputed)   # a launch's
    return encode_report(run, done, merged, encoded, pending, mirrored)


def encode_report(run: RunInputs, done, merged: Consolidated, encoded: int, pending: list[int],
                  mirrored: bool | None) -> EncodeReport:
    """What `encode` returns: the run's sizes, where it resumed, its speed, outputs and mirror."""
    return EncodeReport(
        run_dir=run.run_dir, n_samples=run.plan.n_samples, parts_total=run.plan.n_parts, parts_encoded=encoded,
        resumed_at=run.plan.part_range(pending[0])[0] if pending else 0, seconds=done.seconds,
        samples_per_s=done.samples / done.seconds if done.samples and done.seconds else 0.0,
        offload=run.offload, device=str(run.torch_device), timeline=done.timeline, outputs=merged.outputs,
        mirror_caught_up=mirrored if run.mirror_dir is not None else None, write_seconds=done.write_seconds)


# ------------------------------------------------------------------------------ the phases


@dataclass(frozen=True)
class RunInputs:
    """What every phase of one run reads, checked once by `plan_encode` and never changed after."""

    cache: ImageSource
    run_dir: Path
    mirror_dir: Path | None
    config: PipelineConfig       # with the run's outputs, dtype and n_samples
    plan: RunPlan
    fingerprints: dict           # settings, weights or model, cache: a resume refuses when one changed
    model: EncodeModel           # what encodes (torch), on the CPU until parts are encoded
    torch_device: Any            # the torch.device it encodes on
    offload: str
    reencode_numerics: bool = False   # parts of other numerics are encoded again, not refused


@dataclass(frozen=True)
class EncodedParts:
    """What `encode_parts` did: the manifest after it, the samples, time and per-batch timeline."""

    manifest: dict
    samples: int
    seconds: float
    write_seconds: float                      # of `seconds`: writing parts and the manifest
    timeline: tuple[tuple[float, int], ...]   # (seconds since start, samples encoded), per batch


@dataclass(frozen=True)
class Consolidated:
    """What `consolidate_run` did: the output paths, and the parts it found damaged and recomputed."""

    outputs: dict[str, Path]
    recomputed: tuple[int, ...]


def plan_encode(cache: ImageSource, run_dir: str | Path, config: PipelineConfig, device: str | None = None, *,
                outputs: tuple[str, ...] | None = None, out_dtype: str | None = None,
                mirror_dir: str | Path | None = None, offload: str = "async",
                weights: str | Path | None = None, model=None, world: World = SINGLE, precision: str = "auto",
                reencode_numerics: bool = False) -> RunInputs:
    """Phase 1: check the folders, cache, config and device, load the model, fingerprint the run.

    Nothing is written. ConfigError, CacheError as `encode` documents.
    """
    from nblib.models.load import names_trm

    folder = _require_folder(Path(run_dir), "run folder (--out)")
    mirror = None
    if mirror_dir is not None:
        mirror = on_mirror(Path(mirror_dir), "checking the mirror folder",
                           lambda: _require_folder(Path(mirror_dir), "mirror folder (--mirror)"),
                           default=Path(mirror_dir))
        world.refuse_mirror()                      # one process only: ranks write --out directly
    source = require_image_source(cache)
    run_config = _effective_config(config, len(source), outputs if names_trm(model) else None, out_dtype)
    require_choice("offload", offload, OFFLOAD_MODES)
    _require_complete_cache(source)
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        # the budget's RAM lines count live buffers; without this glibc keeps freed activations
        # resident and a CPU run peaks 1.5-1.8x above them (see measure.pin_malloc_mmap_threshold)
        pin_malloc_mmap_threshold()
    encoder = encode_model(run_config, model, weights, outputs=outputs, precision=precision,
                           image_size=source.image_size, inputs=getattr(source, "inputs", "images"))
    encoder.check_image_size(source.image_size, run_config)
    plan = plan_run(run_config, len(source))
    fingerprints = {"settings": sha256_json(settings_of(run_config, plan.n_samples, encoder)),
                    **encoder.fingerprints(), "cache": source.fingerprint,
                    numerics.KEY: numerics.numerics_of(torch_device, precision)}
    return RunInputs(source, folder, mirror, run_config, plan, fingerprints, encoder, torch_device, offload,
                     reencode_numerics)


def resume(store: PartStore, run: RunInputs, world: World, verify: VerifyLevel = VerifyLevel.STAT) -> dict:
    """Phase 2: the manifest to continue from, read once, checked against this run, parts re-verified.

    A manifest that cannot be read is rebuilt from the parts (each part's meta carries the
    fingerprints); parts the manifest lists but the store cannot verify are recomputed. Only a
    single process writes the result back (the others share the folder: see `World.writes_manifest`).
    """
    old = read_run_manifest(store)
    settings = settings_of(run.config, run.plan.n_samples, run.model)
    encodes = world.role != "consolidate"      # one that only merges takes the parts' numerics as they are
    if old is not None:
        refuse_if_changed(old.get("fingerprints", {}), run.fingerprints, old.get("settings", {}), settings,
                          where=f"the run manifest in {store.local_dir}")
        if encodes and not run.reencode_numerics:
            numerics.refuse_other_numerics(old.get("fingerprints", {}).get(numerics.KEY),
                                           run.fingerprints[numerics.KEY], f"the run manifest in {store.local_dir}",
                                           len(old.get("parts", {})))
    durable = world.durable_parts(store, run.plan.n_parts, verify)   # STAT: part.json, sizes, stat
    fresh = _manifest_of(run, durable, old and old.get("settings"), encodes)
    lost = sorted(set((old or {}).get("parts", {})) - set(fresh["parts"]))
    if lost:
        log.warning("parts %s are listed in the manifest but missing or damaged on disk; they will be "
                    "recomputed", lost)
    if world.writes_manifest and fresh != old:
        store.write_manifest(fresh)
    return fresh


def pending_parts(plan: RunPlan, manifest: dict) -> list[int]:
    """The parts the manifest does not list as durable, in order."""
    return [k for k in range(plan.n_parts) if part_name(k) not in manifest["parts"]]


def encode_parts(run: RunInputs, store: PartStore, manifest: dict, parts: list[int], lock: FolderLock,
                 record: RankRecord | None = None, *, write_manifest: bool = True,
                 progress: bool = False) -> EncodedParts:
    """Phase 4: encode `parts` in order, each written durably then listed; the manifest after them.

    The manifest given is not changed (the one returned is a copy); it is written after each
    part when `write_manifest` (a single process), and each part is added to `record` (a rank's).
    Buffers hold at most the run's samples (a batch size above the cache's length costs no
    more); running out of RAM or VRAM anyway stops with BudgetExceeded, not a traceback.
    """
    manifest = copy.deepcopy(manifest)
    started = time.perf_counter()
    if not parts:
        return EncodedParts(manifest, 0, time.perf_counter() - started, 0.0, ())
    from nblib.encode.offload import BatchClock, HostPart, batch_loader  # imports torch

    plan, config, device = run.plan, run.config, run.torch_device
    run.model.module.to(device).eval()
    batches = [b for k in parts for b in plan.part_batches(k)]
    loader = iter(batch_loader(run.cache, batches, config.run.workers, config.run.prefetch,
                               pin_memory=device.type == "cuda"))
    shapes = {o: tuple(manifest["shapes"][o]) for o in manifest["outputs"]}
    bar = _progress_bar(plan, manifest, progress, "img" if run.model.inputs == "images" else "text")
    shards = VerifiedShards(run.cache)
    clock, encoded, writing = BatchClock(device), 0, 0.0   # on CUDA: completion times, not enqueue times
    try:
        host = HostPart(shapes, min(plan.part_samples, plan.n_samples), config.run.out_dtype, device,
                        run.offload, config.run.consolidate_every)
        for k in parts:
            start, stop = plan.part_range(k)
            for b_start, b_stop in plan.part_batches(k):
                images = next(loader).to(device, non_blocking=True)
                host.add(run.model(images), b_start - start)
                encoded += b_stop - b_start
                clock.mark(encoded)
                bar.update(b_stop - b_start)
            arrays = host.arrays(stop - start)          # waits for the last copy to land
            write_started = time.perf_counter()
            lock.check()                                # still ours: no other run took the folder
            shards.require(start, stop)                 # never a part from a shard that is not the manifest's
            _write_part(store, manifest, plan, k, arrays, write_manifest)
            if record is not None:
                record.wrote(part_name(k))
            writing += time.perf_counter() - write_started
            bar.set_postfix(_postfix(store, manifest, plan, device), refresh=True)
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        batch = min(plan.batch_size, plan.n_samples)
        raise BudgetExceeded(
            f"out of {'GPU ' if device.type == 'cuda' else ''}memory encoding batches of {batch:,} "
            f"samples (batch_size {plan.batch_size:,}) on {device}: {fmt_exception(exc)}; lower "
            f"--batch-size, or run without --no-preflight to see the predicted peak first. "
            f"Finished parts are kept: rerun to resume") from exc
    finally:
        bar.close()
    timeline = tuple(clock.series())
    return EncodedParts(manifest, plan.samples_in(parts), time.perf_counter() - started, writing, timeline)


def consolidate_run(run: RunInputs, store: PartStore, manifest: dict, lock: FolderLock,
                    world: World, verify: VerifyLevel = VerifyLevel.STAT) -> Consolidated:
    """Phase 5: merge the parts; parts found damaged there are deleted, recomputed and merged again (once).

    Several processes never wrote the manifest, so the consolidating one rebuilds it from the
    verified parts first (StateError naming who owes the missing ones). A resume trusts part.json,
    sizes and stat fingerprints; consolidation hashes every byte it reads, so a part whose bytes
    changed behind an unchanged size and mtime fails there. Then every part is hashed on both
    sides (the rare path: a full read) to find all damaged ones. `VerifyLevel.HASH` also hashes
    every consolidated output already there and rebuilds one that differs from its index.
    """
    if not world.writes_manifest:
        manifest = _manifest_of(run, store.list_parts(verify=VerifyLevel.STAT), None)
        store.write_manifest(manifest)
        require_all_parts(run.run_dir, manifest["parts"], run.plan.n_parts)
    try:
        return Consolidated(consolidate(run.run_dir, store=store, lock=lock, verify=verify is VerifyLevel.HASH), ())
    except StateError as exc:
        damaged = {d.name for d in store.verify()[1]} & set(manifest["parts"])
        ks = [k for k in range(run.plan.n_parts) if part_name(k) in damaged]
        if not ks:
            raise
        log.warning("consolidation found damaged parts (%s); recomputing parts %s", exc, sorted(damaged))
    for name in sorted(damaged):
        store.delete_part(name)
    kept = _listing(copy.deepcopy(manifest), {n: r for n, r in manifest["parts"].items() if n not in damaged})
    encode_parts(run, store, kept, ks, lock, write_manifest=True)
    return Consolidated(consolidate(run.run_dir, store=store, lock=lock), tuple(ks))


def resolve_device(name: str | None):
    """The torch.device to encode on: cuda when available for None; ConfigError for one this build lacks."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {name!r} is not one torch knows; encode runs on cpu or cuda "
                          f"(cuda:N for the N-th GPU)") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: encode runs on cpu or cuda only (cuda:N for the N-th GPU)")
    if device.type == "cpu" and device.index not in (None, 0):
        raise ConfigError(f"device {name!r}: the CPU has no numbered devices (torch uses every core as one "
                          f"device); use --device cpu, or cuda:N for the N-th GPU")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = ("this torch build has no CUDA (torch " + torch.__version__ + ")"
                   if torch.version.cuda is None else "no CUDA GPU is visible to this process")
            raise ConfigError(f"device {name!r} asked for, but {why}; use --device cpu, or run on a "
                              f"GPU runtime with a CUDA build of torch")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {name!r} asked for, but this machine has {count} CUDA GPU(s) "
                              f"(cuda:0 to cuda:{count - 1})")
    return device


def run_lock(run_dir: str | Path, fingerprints: dict, rank: int = 0, environ: dict | None = None) -> FolderLock:
    """The lock a run's rank holds on its run folder: ranks of one launch share it (`nblib.lock`).

    Its identity is the run's fingerprints plus the launch (torchrun's run id and rendezvous
    address, else this process): another launch, or a run of other settings, is refused.
    """
    return FolderLock(run_dir, identity=run_identity(f"nblib.encode:{sha256_json(fingerprints)[:16]}", environ),
                      rank=rank, what="run folder", hint="encode into another --out")


# ------------------------------------------------------------------------------ helpers: resume


def _effective_config(config: PipelineConfig, n_samples: int, outputs, out_dtype) -> PipelineConfig:
    changes = {"n_samples": n_samples}
    if outputs is not None:
        changes["outputs"] = tuple(outputs)
    if out_dtype is not None:
        changes["out_dtype"] = out_dtype
    if n_samples < 1:
        raise ConfigError("the cache holds 0 images; populate it before encoding")
    return config.replace(**changes)


def _require_complete_cache(cache: ImageSource) -> None:
    """Refuse a cache that is still being populated (the image size is the model's check)."""
    if not cache.complete:
        raise CacheError(f"the cache holds {len(cache):,} images and is not complete; finish it first "
                         f"(rerun nblib.cache.populate / python -m nblib cache with the same texts)")


def _new_manifest(config: PipelineConfig, plan: RunPlan, fingerprints: dict, model: EncodeModel) -> dict:
    return {"kind": RUN_KIND, "version": RUN_VERSION, "config_name": config.name,
            "settings": settings_of(config, plan.n_samples, model), "fingerprints": fingerprints,
            "n_samples": plan.n_samples, "batch_size": plan.batch_size,
            "checkpoint_every": plan.checkpoint_every, "n_parts": plan.n_parts,
            "outputs": list(model.outputs), "out_dtype": config.run.out_dtype,
            "shapes": {o: list(model.shapes[o]) for o in model.outputs},
            "parts": {}, "samples_done": 0, "complete": False}


def _manifest_of(run: RunInputs, durable: list, old_settings: dict | None, encodes: bool = True) -> dict:
    """A fresh run manifest listing the durable parts of this run (ResumeMismatch for another run's).

    A part names its own settings, so a refusal names the setting that changed even without a
    run manifest (shards). Parts of other numerics are refused, or left out to be encoded again.
    """
    fresh = _new_manifest(run.config, run.plan, run.fingerprints, run.model)
    parts, other = {}, []
    for info in durable:
        meta = dict(info.meta or {})
        if not is_run_part(meta):
            continue
        refuse_if_changed(meta.get("fingerprints", {}), run.fingerprints, meta.get("settings") or old_settings,
                          fresh["settings"], where=f"part {meta.get('name')}")
        if encodes and not numerics.part_is_current(meta, run.fingerprints[numerics.KEY], run.reencode_numerics):
            other.append(meta["name"])
            continue
        parts[meta["name"]] = meta["range"]
    if other:
        log.warning("encoding %d parts made with other numerics again: %s", len(other), other)
    return _listing(fresh, parts)


def _listing(manifest: dict, parts: dict) -> dict:
    """`manifest` listing exactly `parts` (name -> [start, stop]) in name order, with its samples done and
    whether the run is complete; returns it.
    """
    manifest["parts"] = dict(sorted(parts.items()))
    manifest["samples_done"] = sum(stop - start for start, stop in manifest["parts"].values())
    manifest["complete"] = manifest["samples_done"] == manifest["n_samples"]
    return manifest


def _require_folder(folder: Path, what: str) -> Path:
    """`folder`, unless it (or a parent) is a file: ConfigError naming it (a run needs a folder)."""
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"the {what} {folder} cannot be made: {path} is a file, not a folder; "
                                  f"pass another folder (or move that file away) and rerun")
            break
    return folder


def _preflight(run: RunInputs, workspace, pending: list[int], do_consolidate: bool, world: World = SINGLE) -> None:
    """The budget's preflight before the first batch: RAM and VRAM, then each disk written.

    The disks are checked here, with what this run writes to each (`disk_needs`): the parts
    still missing, the consolidated outputs, the mirror's copies. The image cache, already
    complete, takes nothing more. The device preset is the budget's default (t4 with CUDA).
    The TRM's RAM and VRAM lines are the budget's shape arithmetic. Another model's VRAM, on CUDA, is
    the traced budget of its own encode loop (`budget.model_preflight`: the one answer of
    `nblib.budget.model_vram`, on this GPU's preset) at the run's batch, precision and out_dtype; its
    host RAM is not predicted (logged); its disks are checked from its output shapes.
    """
    if workspace is None:
        d = run.run_dir
        workspace = Workspace(drive=d, cache=d, runs=d, checkpoints=d, local=d, staging=d, figures=d)
    if run.model.is_trm:
        budget.preflight(run.config, workspace, job="encode", disk_bytes=0, disk_folder=run.run_dir,   # RAM, VRAM
                         cuda_device=run.torch_device if run.torch_device.type == "cuda" else None)
    else:
        _model_vram_preflight(run)
    per_image = None if run.model.is_trm else run.model.bytes_per_sample(run.config.run.out_dtype)
    check_disks(disk_needs(run.config, run.run_dir, run.mirror_dir, run.plan, pending, do_consolidate,
                           per_image=per_image, n_outputs=len(run.model.outputs)), mirror=run.mirror_dir)
    if run.model.is_trm:
        world.preflight(run.config, str(run.torch_device))          # the host's RAM for all its ranks


def _model_vram_preflight(run: RunInputs) -> None:
    """A non-TRM model on CUDA: its traced encode budget at the run's batch, or BudgetExceeded with the numbers."""
    spec = run.model.loaded.spec
    log.info("preflight: host RAM is not predicted for %s (the budget traces its VRAM only)", spec)
    if run.torch_device.type != "cuda":
        return
    if run.offload != "async":
        log.warning("preflight: the traced budget of %s follows offload=async; offload=%s keeps up to "
                    "consolidate_every=%d batches of outputs on the GPU beyond it", spec, run.offload,
                    run.config.run.consolidate_every)
    precision = "fp16" if run.model.precision == "auto" else run.model.precision   # auto: fp16 autocast on CUDA
    vram = budget.model_preflight(run.model.loaded, min(run.plan.batch_size, run.plan.n_samples), run.torch_device,
                                  precision=precision, out_dtype=run.config.run.out_dtype, inputs=run.model.inputs)
    if vram is not None:
        log.info("preflight: %s fits: %.2f GB of %.2f GB at batch %d (largest that fits: %s; %s)", spec,
                 vram.high / 1e9, vram.limit / 1e9, vram.batch_size, vram.largest_batch, vram.label)


# ------------------------------------------------------------------------------ helpers: the loop


class VerifiedShards:
    """Hashes each cache shard once, before the first part that holds any of its images is written.

    The cache reader hashes a shard only when one process reads it in order, and raises at its
    last image, after earlier batches of it were encoded; with loader workers it cannot hash at
    all. Checking here means no part is ever made durable from shard bytes that are not the
    manifest's (a same-size edit that kept the mtime included). Cost: each shard file is read
    once more, usually from the page cache the loader just filled, and hashed with xxh3 (~10x
    sha256's speed; sha256 stays for identity, in `--verify`). Sources without shard files
    (in-memory arrays) have nothing to check.
    """

    def __init__(self, cache: ImageSource):
        sharded = isinstance(cache, ShardedImageCache)
        self.folder = cache.cache_dir if sharded else None
        self.entries = cache.manifest["shards"] if sharded else []
        self.verified: set[int] = set()

    def require(self, start: int, stop: int) -> None:
        """CacheError naming the shard (and the repair) unless every shard holding [start, stop) matches."""
        for i, entry in enumerate(self.entries):
            if i in self.verified or entry["stop"] <= start or entry["start"] >= stop:
                continue
            state = shard_state(self.folder, entry, full=True, digest="xxh3")
            if state in DAMAGED:
                raise damaged_error(self.folder, entry["file"], WHY_DAMAGED[state] + "; nothing was encoded from it")
            self.verified.add(i)


def _out_of_memory(exc: BaseException) -> bool:
    """True for a failed allocation: MemoryError, torch's OutOfMemoryError, or its allocator's error."""
    text = str(exc)
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or \
        "can't allocate memory" in text or "out of memory" in text.lower()


def _write_part(store: PartStore, manifest: dict, plan: RunPlan, k: int, arrays: dict[str, np.ndarray],
                write_manifest: bool = True) -> None:
    """Write part k durably, then list it in the manifest (written last, by a single process only)."""
    name, (start, stop) = part_name(k), plan.part_range(k)
    store.write_part(name, arrays, part_meta(plan, k, manifest["fingerprints"], manifest["settings"]))
    _listing(manifest, {**manifest["parts"], name: [start, stop]})
    if write_manifest:
        store.write_manifest(manifest)


def _progress_bar(plan: RunPlan, manifest: dict, enabled: bool, unit: str = "img"):
    """The encode bar; counts read as they are ('12/60 img') and only large ones scale ('1.91M img')."""
    from nblib.compare import progress_bar

    return progress_bar(plan.n_samples, "encode", unit, initial=manifest["samples_done"], disable=not enabled,
                        widget=True, unit_scale=plan.n_samples >= 10_000, smoothing=0.1)


def _postfix(store: PartStore, manifest: dict, plan: RunPlan, device) -> dict:
    post = {"parts": f"{len(manifest['parts'])}/{plan.n_parts}", "mirror_lag": store.mirror_lag}
    status = store.mirror_status()
    if status.failing:   # the warning says what to do; the bar says it goes on
        post["mirror"] = "paused: re-authorize Drive" if status.paused else "failing, retrying"
    if device.type == "cuda":
        import torch

        post["gpu_mem"] = f"{torch.cuda.memory_allocated(device) / 2**30:.2f}GiB"
    return post
