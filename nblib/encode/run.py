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

import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib import budget
from nblib.atomic import sha256_json
from nblib.config import PipelineConfig
from nblib.encode import numerics
from nblib.encode.distributed import SINGLE, World, require_all_parts
from nblib.encode.protocols import ImageSource, PartStore, require_image_source, require_part_store
from nblib.errors import BudgetExceeded, CacheError, ConfigError, DriveError, NblibError, ResumeMismatch, StateError
from nblib.lock import FolderLock, run_identity
from nblib.units import fmt_bytes, fmt_bytes_pair, fmt_exception

RUN_KIND = "nblib.encode.run"     # the run manifest's and every part meta's "kind"
RUN_VERSION = 2                   # layout 1 (before nblib 0.2) is refused: encode into a new folder
PARTS_FOLDER = "parts"
OFFLOAD_MODES = ("async", "consolidate")
DISK_BLOCK = 4096                 # the preflight rounds each file up to whole blocks of this size


# ------------------------------------------------------------------------------ the run's plan


@dataclass(frozen=True)
class RunPlan:
    """Where every batch and part of a run begins and ends; fixed, so a resume sees the same batches."""

    n_samples: int
    batch_size: int
    checkpoint_every: int

    @property
    def part_samples(self) -> int:
        return self.batch_size * self.checkpoint_every

    @property
    def n_parts(self) -> int:
        return -(-self.n_samples // self.part_samples)

    def part_range(self, k: int) -> tuple[int, int]:
        """Samples [start, stop) of part k."""
        start = k * self.part_samples
        return start, min(start + self.part_samples, self.n_samples)

    def part_batches(self, k: int) -> list[tuple[int, int]]:
        """Samples [start, stop) of each batch of part k."""
        start, stop = self.part_range(k)
        return [(s, min(s + self.batch_size, stop)) for s in range(start, stop, self.batch_size)]

    @staticmethod
    def part_name(k: int) -> str:
        return f"part-{k:06d}"


def plan_run(config: PipelineConfig, n_samples: int) -> RunPlan:
    """The plan of encoding `n_samples` with the config's batch size and checkpoint cadence."""
    return RunPlan(n_samples, config.run.batch_size, config.run.checkpoint_every)


def settings_of(config: PipelineConfig, n_samples: int) -> dict:
    """The knobs that decide the output bytes (model, batches, parts, outputs, dtype, seed).

    Loader knobs (workers, prefetch, consolidate_every, offload mode) are left out on purpose: a
    resume on another machine may change them without changing a byte.
    """
    r = config.run
    return {"model": dataclasses.asdict(config.model), "n_samples": n_samples,
            "batch_size": r.batch_size, "checkpoint_every": r.checkpoint_every,
            "outputs": list(r.outputs), "out_dtype": r.out_dtype, "seed": r.seed}


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
        lines = [f"encoded {self.parts_encoded} of {self.parts_total} parts "
                 f"({self.n_samples:,} samples{resumed}) on {self.device} in {self.seconds:.1f} s, "
                 f"{self.samples_per_s:,.1f} samples/s, offload={self.offload}"]
        if self.mirror_caught_up is False:
            lines.append("  the mirror is behind: every part is safe locally; rerun to catch it up")
        lines += [f"  {name:<9} {path}" for name, path in self.outputs.items()]
        return "\n".join(lines)


def encode(cache: ImageSource, run_dir: str | Path, config: PipelineConfig, device: str | None = None, *,
           outputs: tuple[str, ...] | None = None, out_dtype: str | None = None,
           mirror_dir: str | Path | None = None, progress: bool = True, offload: str = "async",
           weights: str | Path | None = None, preflight: bool = True, workspace=None,
           do_consolidate: bool = True, store: PartStore | None = None,
           world: World | None = None, verify: bool = False, precision: str = "auto",
           reencode_numerics: bool = False) -> EncodeReport:
    """Encode every image of `cache` into parts under `run_dir`, resuming what is durable.

    `outputs` / `out_dtype` override the config's; `weights` loads trained weights (default: the
    seeded initialization); `offload` is "async" (per-batch copies to pinned host buffers) or
    "consolidate" (keep `consolidate_every` batches on the GPU, then one copy). A `store` given
    is used as it is and left open; otherwise one is opened on run_dir/parts and closed. The run
    holds the run folder's lock (`run_lock`) throughout: a second run on it gets FolderBusyError.
    `world` (`nblib.encode.distributed.join()`) makes this process one rank or shard of several:
    it encodes its share of the parts, and only the consolidating one merges them. A resume
    checks parts by metadata (part.json, sizes, stat); `verify=True` hashes every part first, and
    the consolidated outputs too (a damaged one is rebuilt). `precision` is the encoder's ("auto":
    fp16 autocast on CUDA, fp32 on CPU); the device, the precision used and the torch/CUDA versions
    are recorded (`nblib.encode.numerics`), and a resume with other ones is refused unless
    `reencode_numerics` (the parts made with other numerics are encoded again).
    """
    from nblib.encode.consolidate import consolidate

    world = world if world is not None else SINGLE

    run_dir = _require_folder(Path(run_dir), "run folder (--out)")
    if mirror_dir is not None:
        _require_folder(Path(mirror_dir), "mirror folder (--mirror)")
        world.refuse_mirror()                      # one process only: ranks write --out directly
    cache = require_image_source(cache)
    config = _effective_config(config, len(cache), outputs, out_dtype)
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"offload={offload!r} is unknown; choose one of {OFFLOAD_MODES}")
    _require_usable_cache(cache, config)
    device = resolve_device(device)
    if device.type == "cpu":
        # the budget's RAM lines count live buffers; without this glibc keeps freed activations
        # resident and a CPU run peaks 1.5-1.8x above them (see malloc.pin_malloc_mmap_threshold)
        from nblib.malloc import pin_malloc_mmap_threshold

        pin_malloc_mmap_threshold()
    encoder = load_encoder(config, weights).set_inference(precision=precision)
    plan = plan_run(config, len(cache))
    identity = {"settings": sha256_json(settings_of(config, plan.n_samples)),
                "weights": encoder.weights_fingerprint(), "cache": cache.fingerprint}
    fingerprints = {**identity, numerics.KEY: numerics.numerics_of(device, precision)}
    with run_lock(run_dir, identity, world.rank, world.lock_environ) as lock:   # another run is refused
        own_store = store is None
        store = open_store(run_dir, mirror_dir, identity) if own_store else require_part_store(store)
        store = world.part_store(store, run_dir, plan.n_parts)   # ranks: parts go through, no manifest writes
        manifest = _resume_manifest(store, config, plan, fingerprints, verify=True if verify else "quick",
                                    numerics_apply=world.role != "consolidate", reencode=reencode_numerics)
        pending = [k for k in range(plan.n_parts) if plan.part_name(k) not in manifest["parts"]]
        resumed_at = plan.part_range(pending[0])[0] if pending else plan.n_samples
        missing = world.assign(pending, plan.n_parts, store, fingerprints)   # this process's share
        if missing and preflight:
            _preflight(config, workspace, run_dir, mirror_dir, plan, pending, do_consolidate)
            world.preflight(config, str(device))

        started = time.perf_counter()
        timeline: list[tuple[float, int]] = []
        write_seconds = 0.0
        if missing:
            encoder.to(device).eval()
            with world.progress(run_dir, plan.n_parts, progress):   # one bar over all ranks' parts
                timeline, write_seconds = _encode_parts(cache, encoder, store, manifest, plan, missing, config,
                                                        device, offload, progress and not world.distributed, lock)
        seconds = time.perf_counter() - started
        encoded = sum(plan.part_range(k)[1] - plan.part_range(k)[0] for k in missing)
        world.barrier("the end, once every rank has written its parts")
        consolidating = do_consolidate and world.consolidates
        if consolidating and world.distributed:   # ranks never write the manifest: rebuilt from the parts
            manifest = _resume_manifest(store.inner, config, plan, fingerprints)
            require_all_parts(run_dir, manifest["parts"], plan.n_parts)
        paths, recomputed = _consolidate_recomputing(
            lambda: consolidate(run_dir, store=store, lock=lock, verify=bool(verify)), store, manifest, plan,
            lambda ks: _encode_parts(cache, encoder.to(device).eval(), store, manifest, plan, ks, config, device,
                                     offload, False, lock)) if consolidating else ({}, [])
        mirrored = store.close() if own_store else None  # waits for the mirror; warns if it is failing
    return EncodeReport(
        run_dir=run_dir, n_samples=plan.n_samples, parts_total=plan.n_parts,
        parts_encoded=(len(pending) if world.role == "rank" else len(missing)) + len(recomputed),  # a launch's
        resumed_at=resumed_at if resumed_at < plan.n_samples else 0,
        seconds=seconds, samples_per_s=encoded / seconds if encoded and seconds else 0.0,
        offload=offload, device=str(device), timeline=tuple(timeline), outputs=paths,
        mirror_caught_up=mirrored if mirror_dir is not None else None, write_seconds=write_seconds)


def load_encoder(config: PipelineConfig, weights: str | Path | None = None):
    """The seeded encoder of a config, with trained weights loaded when a path is given.

    ConfigError when `weights` is missing, a folder, or not a file `save_weights` wrote.
    """
    from nblib.trm import TRMVisionEncoder

    encoder = TRMVisionEncoder(config, seed=config.run.seed)
    if weights is None:
        return encoder
    path = Path(weights)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"weights {path} {what}: pass the file TRMVisionEncoder.save_weights wrote, "
                          f"or leave weights out (no --weights) to encode with the seeded initial weights")
    try:
        return encoder.load_weights(path)
    except (NblibError, OSError):
        raise
    except Exception as exc:  # torch.load fails on garbage with many types: unpickling, zip, key, index
        raise ConfigError(f"weights {path} ({path.stat().st_size:,} bytes) is not a file that "
                          f"TRMVisionEncoder.save_weights wrote ({type(exc).__name__} reading it); pass such "
                          f"a file, or leave weights out to use the seeded initial weights") from exc


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


def open_store(run_dir: str | Path, mirror_dir: str | Path | None = None, identity: dict | None = None) -> PartStore:
    """The DurableStore holding a run's parts and manifest (run_dir/parts, mirrored if asked).

    `identity` (the run's fingerprints) claims the mirror folder for this run: a mirror another
    run claimed is refused (ForeignMirror, naming the mirror folder).
    """
    from nblib.store import DurableStore

    return DurableStore(Path(run_dir) / PARTS_FOLDER, mirror_dir=mirror_dir, identity=identity)


def read_run_manifest(store: PartStore) -> dict | None:
    """The run manifest of a store, or None when there is none or it is damaged (with a warning).

    The newest copy of either side; local staging's alone (with a warning) while the mirror is
    unreachable. StateError when the store holds something else (another kind, an older layout).
    """
    try:
        try:
            manifest = store.read_manifest()
        except DriveError as exc:
            warnings.warn(f"{exc}; reading the run manifest of local staging only", stacklevel=3)
            manifest = store.read_manifest(local_only=True)
    except (StateError, OSError) as exc:
        warnings.warn(f"the run manifest cannot be read ({exc}); rebuilding it from the parts",
                      stacklevel=3)
        return None
    if manifest is not None and (manifest.get("kind"), manifest.get("version")) != (RUN_KIND, RUN_VERSION):
        raise StateError(f"{store.local_dir} holds a manifest of kind {manifest.get('kind')!r} "
                         f"(layout {manifest.get('version')!r}), not an encode run of layout "
                         f"{RUN_VERSION}; encode into an empty --out folder, or delete this one")
    return manifest


def part_meta(plan: RunPlan, k: int, fingerprints: dict, settings: dict | None = None) -> dict:
    """The meta written with part k: what it is, which samples it holds, the run's fingerprints and
    settings (so a refusal names the setting that changed, even with no run manifest: shards).
    """
    meta = {"kind": RUN_KIND, "version": RUN_VERSION, "name": plan.part_name(k),
            "range": list(plan.part_range(k)), "fingerprints": fingerprints}
    if settings is not None:
        meta["settings"] = settings
    return meta


def refuse_if_changed(old: dict, new: dict, old_settings: dict | None, new_settings: dict | None,
                      where: str) -> None:
    """ResumeMismatch naming each fingerprint (and setting) that differs between two runs."""
    changed = [k for k in ("settings", "weights", "cache") if k in old and old[k] != new.get(k)]
    if not changed:
        return
    details = []
    for key in changed:
        if key == "settings" and old_settings and new_settings:
            diffs = _setting_diffs(old_settings, new_settings) or ["fingerprint differs"]
            details.append("settings changed (" + "; ".join(diffs) + ")")
        else:
            details.append(f"{key} changed ({old[key][:12]} -> {str(new.get(key))[:12]})")
    raise ResumeMismatch(
        f"{where} was made with other inputs: {', '.join(details)}. Resuming would mix outputs "
        f"of two different runs; rerun with the original cache, weights and settings, or encode "
        f"into a new --out folder")


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


def _require_usable_cache(cache: ImageSource, config: PipelineConfig) -> None:
    """Refuse a cache that is still being populated or holds images of another size."""
    if not cache.complete:
        raise CacheError(f"the cache holds {len(cache):,} images and is not complete; finish it first "
                         f"(rerun nblib.cache.populate / python -m nblib cache with the same texts)")
    size = cache.image_size
    if size != config.model.image_size:
        raise ConfigError(
            f"the cache holds {size}x{size} images, the {config.name} model expects "
            f"{config.model.image_size}x{config.model.image_size}; pick a profile with "
            f"image_size={size} or re-render the cache at image_size={config.model.image_size}")


def _new_manifest(config: PipelineConfig, plan: RunPlan, fingerprints: dict) -> dict:
    shapes = budget.output_shapes(config.model)
    return {"kind": RUN_KIND, "version": RUN_VERSION, "config_name": config.name,
            "settings": settings_of(config, plan.n_samples), "fingerprints": fingerprints,
            "n_samples": plan.n_samples, "batch_size": plan.batch_size,
            "checkpoint_every": plan.checkpoint_every, "n_parts": plan.n_parts,
            "outputs": list(config.run.outputs), "out_dtype": config.run.out_dtype,
            "shapes": {o: list(shapes[o]) for o in config.run.outputs},
            "parts": {}, "samples_done": 0, "complete": False}


def _resume_manifest(store: PartStore, config: PipelineConfig, plan: RunPlan, fingerprints: dict,
                     verify: bool | str = "quick", numerics_apply: bool = True, reencode: bool = False) -> dict:
    """The manifest to continue from: checked against this run, parts re-verified on disk.

    A manifest that cannot be read is rebuilt from the parts (each part's meta carries the
    fingerprints and settings); parts the manifest lists but the store cannot verify are
    recomputed. Parts made with other numerics (device, precision, torch) are refused, or with
    `reencode` left out so they are encoded again; `numerics_apply=False` (a process that only
    consolidates, encoding nothing) takes them as they are.
    """
    fresh = _new_manifest(config, plan, fingerprints)
    mine = fingerprints.get(numerics.KEY)
    old = read_run_manifest(store)
    if old is not None:
        refuse_if_changed(old.get("fingerprints", {}), fingerprints, old.get("settings", {}),
                          fresh["settings"], where=f"the run manifest in {store.local_dir}")
        if numerics_apply and not reencode:
            numerics.refuse_other_numerics(old.get("fingerprints", {}).get(numerics.KEY), mine,
                                           f"the run manifest in {store.local_dir}", len(old.get("parts", {})))
    durable, other_numerics = {}, []
    for info in store.list_parts(verify=verify):      # "quick": part.json, sizes, stat; hashed when changed
        meta = dict(info.meta or {})
        if (meta.get("kind"), meta.get("version")) != (RUN_KIND, RUN_VERSION):
            continue
        refuse_if_changed(meta.get("fingerprints", {}), fingerprints, meta.get("settings") or (old and old.get(
            "settings")), fresh["settings"], where=f"part {meta.get('name')}")
        theirs = meta.get("fingerprints", {}).get(numerics.KEY)
        if numerics_apply and theirs and theirs != mine:
            if not reencode:
                numerics.refuse_other_numerics(theirs, mine, f"part {meta.get('name')}")
            other_numerics.append(meta["name"])
            continue                                  # encoded again with this process's numerics
        durable[meta["name"]] = meta["range"]
    if other_numerics:
        warnings.warn(f"re-encoding {len(other_numerics)} parts made with other numerics "
                      f"({'; '.join(numerics.numerics_changes(theirs, mine))})", stacklevel=3)
    listed = set((old or {}).get("parts", {}))
    if listed - set(durable):
        warnings.warn(f"parts {sorted(listed - set(durable))} are listed in the manifest but "
                      f"missing or damaged on disk; they will be recomputed", stacklevel=3)
    fresh["parts"] = {name: durable[name] for name in sorted(durable)}
    fresh["samples_done"] = sum(stop - start for start, stop in fresh["parts"].values())
    fresh["complete"] = fresh["samples_done"] == plan.n_samples
    if fresh != old:
        store.write_manifest(fresh)
    return fresh


def _require_folder(folder: Path, what: str) -> Path:
    """`folder`, unless it (or a parent) is a file: ConfigError naming it (a run needs a folder)."""
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"the {what} {folder} cannot be made: {path} is a file, not a folder; "
                                  f"pass another folder (or move that file away) and rerun")
            break
    return folder


def _consolidate_recomputing(consolidate_run, store: PartStore, manifest: dict, plan: RunPlan,
                             recompute) -> tuple[dict, list[int]]:
    """Consolidate; parts found damaged there are deleted, recomputed and consolidated again (once).

    A resume trusts part.json, sizes and stat fingerprints; consolidation hashes every byte it
    reads, so a part whose bytes changed behind an unchanged size and mtime fails there. Then
    every part is hashed on both sides (the rare path: a full read) to find all damaged ones.
    """
    try:
        return consolidate_run(), []
    except StateError as exc:
        damaged = {d.name for d in store.verify()[1]}
        ks = [k for k in range(plan.n_parts) if plan.part_name(k) in damaged & set(manifest["parts"])]
        if not ks:
            raise
        warnings.warn(f"consolidation found damaged parts ({exc}); recomputing parts "
                      f"{[plan.part_name(k) for k in ks]}", stacklevel=3)
    for k in ks:
        store.delete_part(plan.part_name(k))
        start, stop = manifest["parts"].pop(plan.part_name(k))
        manifest["samples_done"] -= stop - start
        manifest["complete"] = False
    recompute(ks)
    return consolidate_run(), ks


def _setting_diffs(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every setting that differs (model fields as model.<field>)."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"model.{d}" for d in _setting_diffs(a, b)]
        elif a != b:
            diffs.append(f"{key}: {a} -> {b}")
    return diffs


def _preflight(config: PipelineConfig, workspace, run_dir: Path, mirror_dir, plan: RunPlan,
               missing: list[int], do_consolidate: bool) -> None:
    """The budget's preflight before the first batch: RAM and VRAM, then each disk written.

    The disks are checked here, with what this run writes to each (`disk_needs`): the parts
    still missing, the consolidated outputs, the mirror's copies. The image cache, already
    complete, takes nothing more. The device preset is the budget's default (t4 with CUDA).
    """
    from nblib.env import Workspace

    if workspace is None:
        workspace = Workspace(drive=run_dir, cache=run_dir, runs=run_dir, checkpoints=run_dir,
                              local=run_dir, staging=run_dir, figures=run_dir)
    budget.preflight(config, workspace, job="encode", disk_bytes=0, disk_folder=run_dir)  # RAM, VRAM
    check_disks(disk_needs(config, run_dir, mirror_dir, plan, missing, do_consolidate))


def disk_needs(config: PipelineConfig, run_dir: Path, mirror_dir, plan: RunPlan, missing: list[int],
               do_consolidate: bool = True) -> dict[str, tuple[Path, int]]:
    """What the rest of a run writes, by item: name -> (folder it lands in, bytes).

    Each file is rounded up to whole 4 KiB blocks (part.json and headers included), so a disk
    of many small parts is not under-counted.
    """
    per_image = budget.output_bytes_per_image(config)
    outputs = len(config.run.outputs)
    left = sum(plan.part_range(k)[1] - plan.part_range(k)[0] for k in missing)
    parts = left * per_image + len(missing) * (outputs + 1) * DISK_BLOCK
    needs = {"parts still to encode": (run_dir, parts)}
    if do_consolidate:
        needs["consolidated outputs"] = (run_dir, plan.n_samples * per_image + (outputs + 1) * DISK_BLOCK)
    if mirror_dir is not None:
        needs["mirrored parts"] = (Path(mirror_dir), parts)
    return needs


def check_disks(needs: dict[str, tuple[Path, int]]) -> None:
    """BudgetExceeded naming the disk, the items on it, needed and free bytes, when one does not fit.

    Items on one file system (the same st_dev) are added up; a disk nothing lands on is not
    charged at all.
    """
    from nblib.disk import disk_free, existing_parent

    by_disk: dict[int, list[tuple[str, Path, int]]] = {}
    for item, (folder, nbytes) in needs.items():
        by_disk.setdefault(existing_parent(folder).stat().st_dev, []).append((item, folder, nbytes))
    for items in by_disk.values():
        need, folder = sum(n for _, _, n in items), items[0][1]
        free = disk_free(folder)
        if need > free:
            need_s, free_s = fmt_bytes_pair(need, free)
            what = " + ".join(f"{item} {fmt_bytes(n)} in {f}" for item, f, n in items)
            raise BudgetExceeded(
                f"the encode run needs {need_s} ({need:,} bytes) on the disk of {existing_parent(folder)} "
                f"but only {free_s} ({free:,} bytes) is free there ({what}); free space, put --out or "
                f"--mirror on a larger disk, keep fewer --outputs or use --dtype float16")


# ------------------------------------------------------------------------------ helpers: the loop


def _encode_parts(cache: ImageSource, encoder, store: PartStore, manifest: dict, plan: RunPlan,
                  missing: list[int], config: PipelineConfig, device, offload: str,
                  progress: bool, lock: FolderLock) -> tuple[list[tuple[float, int]], float]:
    """Encode the missing parts in order, each written then listed: (timeline, seconds writing).

    Buffers hold at most the run's samples (a batch size above the cache's length costs no
    more); running out of RAM or VRAM anyway stops with BudgetExceeded, not a traceback.
    """
    from nblib.encode.offload import HostPart, batch_loader

    batches = [b for k in missing for b in plan.part_batches(k)]
    loader = iter(batch_loader(cache, batches, config.run.workers, config.run.prefetch,
                               pin_memory=device.type == "cuda"))
    shapes = {o: tuple(manifest["shapes"][o]) for o in manifest["outputs"]}
    bar = _progress_bar(plan, manifest, progress)
    shards = VerifiedShards(cache)
    started, encoded, timeline, writing = time.perf_counter(), 0, [], 0.0
    try:
        host = HostPart(shapes, min(plan.part_samples, plan.n_samples), config.run.out_dtype, device,
                        offload, config.run.consolidate_every)
        for k in missing:
            start, stop = plan.part_range(k)
            for b_start, b_stop in plan.part_batches(k):
                images = next(loader).to(device, non_blocking=True)
                host.add(encoder.encode(images), b_start - start)
                encoded += b_stop - b_start
                timeline.append((time.perf_counter() - started, encoded))
                bar.update(b_stop - b_start)
            arrays = host.arrays(stop - start)          # waits for the last copy to land
            write_started = time.perf_counter()
            lock.check()                                # still ours: no other run took the folder
            shards.require(start, stop)                 # never a part from a shard that is not the manifest's
            _write_part(store, manifest, plan, k, arrays)
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
    return timeline, writing


class VerifiedShards:
    """Hashes each cache shard once, before the first part that holds any of its images is written.

    The cache reader hashes a shard only when one process reads it in order, and raises at its
    last image, after earlier batches of it were encoded; with loader workers it cannot hash at
    all. Checking here means no part is ever made durable from shard bytes that are not the
    manifest's (a same-size edit that kept the mtime included). Cost: each shard file is read
    once more, usually from the page cache the loader just filled. Sources without shard files
    (in-memory arrays) have nothing to check.
    """

    def __init__(self, cache: ImageSource):
        from nblib.cache import ShardedImageCache

        sharded = isinstance(cache, ShardedImageCache)
        self.folder = cache.cache_dir if sharded else None
        self.entries = cache.manifest["shards"] if sharded else []
        self.verified: set[int] = set()

    def require(self, start: int, stop: int) -> None:
        """CacheError naming the shard (and the repair) unless every shard holding [start, stop) matches."""
        from nblib.cache.format import DAMAGED, damaged_error, shard_state

        for i, entry in enumerate(self.entries):
            if i in self.verified or entry["stop"] <= start or entry["start"] >= stop:
                continue
            state = shard_state(self.folder, entry, full=True)
            if state in DAMAGED:
                why = {"missing": "missing", "truncated": "of another size than the manifest records",
                       "corrupt": "not the shard the manifest records (its sha256 differs)"}[state]
                raise damaged_error(self.folder, entry["file"], why + "; nothing was encoded from it")
            self.verified.add(i)


def _out_of_memory(exc: BaseException) -> bool:
    """True for a failed allocation: MemoryError, torch's OutOfMemoryError, or its allocator's error."""
    text = str(exc)
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or \
        "can't allocate memory" in text or "out of memory" in text.lower()


def _write_part(store: PartStore, manifest: dict, plan: RunPlan, k: int, arrays: dict[str, np.ndarray]) -> None:
    """Write part k durably, then list it in the manifest (the manifest is always written last)."""
    name, (start, stop) = plan.part_name(k), plan.part_range(k)
    store.write_part(name, arrays, part_meta(plan, k, manifest["fingerprints"], manifest["settings"]))
    manifest["parts"][name] = [start, stop]
    manifest["parts"] = dict(sorted(manifest["parts"].items()))
    manifest["samples_done"] += stop - start
    manifest["complete"] = manifest["samples_done"] == plan.n_samples
    store.write_manifest(manifest)


def _progress_bar(plan: RunPlan, manifest: dict, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=plan.n_samples, initial=manifest["samples_done"], unit="img",
                unit_scale=True, desc="encode", disable=not enabled, smoothing=0.1)


def _postfix(store: PartStore, manifest: dict, plan: RunPlan, device) -> dict:
    post = {"parts": f"{len(manifest['parts'])}/{plan.n_parts}", "mirror_lag": store.mirror_lag}
    status = store.mirror_status()
    if status.failing:   # the warning says what to do; the bar says it goes on
        post["mirror"] = "paused: re-authorize Drive" if status.paused else "failing, retrying"
    if device.type == "cuda":
        import torch

        post["gpu_mem"] = f"{torch.cuda.memory_allocated(device) / 2**30:.2f}GiB"
    return post
