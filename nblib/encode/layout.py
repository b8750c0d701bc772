"""An encode run's layout: its folders, part names, plan, kind and version, and its manifest checks.

The one home of what `run` (writing parts), `consolidate` (merging them) and `distributed`
(splitting them over processes) all read: where parts live (`<run>/parts/part-000000/`), how
samples map to batches and parts (`RunPlan`), the kind and layout version every run manifest
and part meta carries, the settings that decide the output bytes, reading the run manifest and
refusing a resume whose fingerprints changed. It imports none of those three modules, so they
can all import it (no cycle).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from nblib.config import PipelineConfig
from nblib.encode.protocols import PartStore
from nblib.errors import DriveError, ResumeMismatch, StateError
from nblib.store import DurableStore

__all__ = [
    "PARTS_FOLDER", "RUN_KIND", "RUN_VERSION", "RunPlan", "is_run_part", "open_store", "part_meta",
    "part_name", "parts_dir", "plan_run", "read_run_manifest", "refuse_if_changed", "settings_of",
]

log = logging.getLogger(__name__)

RUN_KIND = "nblib.encode.run"     # the run manifest's and every part meta's "kind"
RUN_VERSION = 2                   # layout 1 (before nblib 0.2) is refused: encode into a new folder
PARTS_FOLDER = "parts"            # under the run folder: the DurableStore of parts and the run manifest


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

    def samples_in(self, parts: list[int]) -> int:
        """How many samples the parts `parts` hold together."""
        return sum(self.part_range(k)[1] - self.part_range(k)[0] for k in parts)


def part_name(k: int) -> str:
    """The folder name of part k: part-000000, part-000001, ..."""
    return f"part-{k:06d}"


def plan_run(config: PipelineConfig, n_samples: int) -> RunPlan:
    """The plan of encoding `n_samples` with the config's batch size and checkpoint cadence."""
    return RunPlan(n_samples, config.run.batch_size, config.run.checkpoint_every)


def settings_of(config: PipelineConfig, n_samples: int, model=None) -> dict:
    """The knobs that decide the output bytes (model, batches, parts, outputs, dtype, seed).

    Loader knobs (workers, prefetch, consolidate_every, offload mode) are left out on purpose: a
    resume on another machine may change them without changing a byte. `model` (an
    `nblib.encode.model.EncodeModel`) puts in a model other than the TRM: its class and outputs.
    """
    r = config.run
    settings = {"model": dataclasses.asdict(config.model), "n_samples": n_samples,
                "batch_size": r.batch_size, "checkpoint_every": r.checkpoint_every,
                "outputs": list(r.outputs), "out_dtype": r.out_dtype, "seed": r.seed}
    return model.settings(settings) if model is not None else settings


def part_meta(plan: RunPlan, k: int, fingerprints: dict, settings: dict) -> dict:
    """The meta written with part k: what it is, which samples it holds, the run's fingerprints and
    settings (so a refusal names the setting that changed, even with no run manifest: shards).
    """
    return {"kind": RUN_KIND, "version": RUN_VERSION, "name": part_name(k),
            "range": list(plan.part_range(k)), "fingerprints": fingerprints, "settings": settings}


def is_run_part(meta: dict) -> bool:
    """True when a part's meta says it belongs to an encode run of this layout."""
    return (meta.get("kind"), meta.get("version")) == (RUN_KIND, RUN_VERSION)


def parts_dir(run_dir: str | Path) -> Path:
    """The folder holding a run's parts and run manifest."""
    return Path(run_dir) / PARTS_FOLDER


def open_store(run_dir: str | Path, mirror_dir: str | Path | None = None, identity: dict | None = None) -> PartStore:
    """The DurableStore holding a run's parts and manifest (run_dir/parts, mirrored if asked).

    `identity` (the run's fingerprints) claims the mirror folder for this run: a mirror another
    run claimed is refused (ForeignMirror, naming the mirror folder).
    """
    return DurableStore(parts_dir(run_dir), mirror_dir=mirror_dir, identity=identity)


def read_run_manifest(store: PartStore) -> dict | None:
    """The run manifest of a store, or None when there is none or it is damaged (logged).

    The newest copy of either side; local staging's alone (logged) while the mirror is
    unreachable. StateError when the store holds something else (another kind, an older layout).
    """
    try:
        try:
            manifest = store.read_manifest()
        except DriveError as exc:
            log.warning("%s; reading the run manifest of local staging only", exc)
            manifest = store.read_manifest(local_only=True)
    except (StateError, OSError) as exc:
        log.warning("the run manifest cannot be read (%s); rebuilding it from the parts", exc)
        return None
    if manifest is not None and not is_run_part(manifest):
        raise StateError(f"{store.local_dir} holds a manifest of kind {manifest.get('kind')!r} "
                         f"(layout {manifest.get('version')!r}), not an encode run of layout "
                         f"{RUN_VERSION}; encode into an empty --out folder, or delete this one")
    return manifest


def refuse_if_changed(old: dict, new: dict, old_settings: dict | None, new_settings: dict | None,
                      where: str) -> None:
    """ResumeMismatch naming each fingerprint (and setting) that differs between two runs."""
    details = _model_changes(old, new)
    model_keys = ("weights",) if details else ()       # the TRM's weights vs another model: said once
    changed = [k for k in ("settings", "weights", "cache") if k in old and k not in model_keys
               and old[k] != new.get(k)]
    if not changed and not details:
        return
    for key in changed:
        if key == "settings" and old_settings and new_settings:
            from nblib.models.identity import dict_changes

            diffs = [d.removeprefix("settings.") for d in dict_changes("settings", old_settings, new_settings)]
            diffs = diffs or ["fingerprint differs"]
            details.append("settings changed (" + "; ".join(diffs) + ")")
        else:
            details.append(f"{key} changed ({old[key][:12]} -> {str(new.get(key))[:12]})")
    raise ResumeMismatch(
        f"{where} was made with other inputs: {', '.join(details)}. Resuming would mix outputs "
        f"of two different runs; rerun with the original cache, model, weights and settings, or encode "
        f"into a new --out folder")


def _model_changes(old: dict, new: dict) -> list[str]:
    """The model's part of a refusal: another model than the TRM, or what differs between two models."""
    from nblib.models import describe_changes

    if "model" not in old and "model" not in new:
        return []
    if ("model" in old) != ("model" in new):
        was = old["model"].get("spec") if "model" in old else "the TRM (trm)"
        now = new["model"].get("spec") if "model" in new else "the TRM (trm)"
        return [f"model changed ({was} -> {now})"]
    change = describe_changes(old["model"], new["model"])
    return [change] if change else []

