"""Train states local-first, copied to a mirror (a Drive folder or a bucket): training's adapter over
`nblib.store.CheckpointManager`, the checkpoint manager encode uses too.

What a save writes, when, and what retention keeps on each side: "Writer" and "Retention and cost" in
docs/training.md. Trade-off: between backups the newest states exist on one disk only; the backup interval
bounds what a lost VM costs; a save costs the loop a copy of the state into host buffers, not its write.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from nblib.budget.training import retained_versions
from nblib.errors import DriveError
from nblib.store.manager import CheckpointManager
from nblib.store.mirror import MirrorStatus

from .objstore import is_url, mirror_target

STATE, BEST = "state", "best"
log = logging.getLogger("nblib.train")
FOLDER = "checkpoints"


@dataclass(frozen=True)
class Durability:
    """Where the run's newest state stands: local step, last step queued and known on the mirror."""

    local_step: int
    queued_step: int | None
    mirror_caught_up: bool
    mirror_failing: bool
    last_error: str | None

    def line(self) -> str:
        if self.queued_step is None:
            return f"step {self.local_step} is saved locally only (no mirror)"
        if self.mirror_caught_up:
            if self.queued_step >= self.local_step:
                return f"mirror holds step {self.queued_step}, the newest"
            return f"mirror holds step {self.queued_step}; steps after it (to {self.local_step}) are local only"
        why = f" ({self.last_error})" if self.mirror_failing and self.last_error else ""
        return (f"NOT YET DURABLE: the mirror has not confirmed step {self.queued_step}{why}; "
                f"the newest state (step {self.local_step}) is on local disk only; rerun to retry the copy")


class TrainStore:
    """A run's train states and best weights over one CheckpointManager: local folder first, mirror behind.

    `identity` (the run's: config, cache fingerprint, classes, ...) claims the mirror folder; `deadline_s`
    bounds each mirror read (default NBLIB_MIRROR_DEADLINE_S; train passes --mirror-timeout); `writer`
    (default `start_mirror`) is the process that holds the run folder: only it removes temporaries,
    claims the mirror and runs the mirror thread. A reader (`start_mirror=False`) only loads.
    """

    def __init__(self, run_dir: str | Path, mirror: str | Path | None = None, *, keep_last: int = 3,
                 storage_options: dict | None = None, retries: int = 3, backoff_s: float = 0.5,
                 retry_interval_s: float = 30.0, remount=None, start_mirror: bool = True,
                 sync_save: bool = False, quota_bytes: int | None = None, identity: dict | None = None,
                 writer: bool | None = None, deadline_s: float | None = None):
        self.local_root = Path(run_dir) / FOLDER
        self.keep_last = keep_last
        self.mirror_label = None if mirror is None else str(mirror)
        self._mirror_dir = None if mirror is None or is_url(mirror) else Path(mirror)
        self.watch, self._sizes = None, {}
        self.quota_bytes = quota_bytes     # the mirror folder's quota (Drive) for the disk watch
        self.sync_save = sync_save
        self.startup_timeout_s = deadline_s or 60.0   # a stalled mirror at start: give up on it after this
        root, ops = (None, None) if mirror is None else mirror_target(mirror, storage_options)
        states, bests = retained_versions(keep_last)
        self.manager = CheckpointManager(
            self.local_root, None if root is None else root / FOLDER,
            mirror_ops=ops if mirror is not None and is_url(mirror) else None, keep_last=states,
            keep_per_name={BEST: bests},
            identity=identity, writer=start_mirror if writer is None else writer,
            clean_temporaries=start_mirror if writer is None else writer, prune_unmirrored=True,
            retries=retries, backoff_s=backoff_s, retry_interval_s=retry_interval_s, remount=remount,
            deadline_s=deadline_s, on_saved=self._saved, version_label="step")
        self.local = self.manager.local
        self._guarded = self._hook = None
        self.fence_seconds = 0.0          # what optimizer steps waited for a deferred snapshot, in all

    def save(self, state: dict, step: int, *, backup: bool, best: dict | None = None) -> float:
        """Write `state` as version `step` locally (atomic), `best` first as the best series' version `step`;
        queue both for the mirror when `backup`. Asynchronous unless `sync_save`: what is written is `state`
        as it is at this call (its tensors and containers copied now, the files written on the writer
        thread); with a `guard`ed optimizer, its moments on CUDA are copied in stream order without the loop
        waiting (`guard`). The seconds waited for the previous write.
        """
        defer = () if self._guarded is None else optimizer_moments(self._guarded)
        self.manager.save({BEST: best, STATE: state}, step, backup=backup, blocking=self.sync_save,
                          backup_also=(BEST,), defer=defer)
        return self.manager.last_wait_s

    def guard(self, optimizer) -> None:
        """Let asynchronous saves copy `optimizer`'s CUDA moments in stream order without the loop waiting: its
        next `step` first waits until the save in flight holds them (a step pre-hook; `fence_seconds` adds up
        the waits). The checkpoint holds the state of the save's call whatever edits it later ("Writer" in
        docs/training.md).
        """
        if self.sync_save or self._guarded is not None:
            return
        self._guarded = optimizer
        self._hook = optimizer.register_step_pre_hook(self._fence)

    def _fence(self, *_args) -> None:
        self.fence_seconds += self.manager.fence()

    def wait_saves(self) -> float:
        """Wait for the write in flight; raise its error if it failed. The seconds waited."""
        return self.manager.wait()

    @property
    def write_seconds(self) -> list[float]:
        """What each background write took."""
        return self.manager.write_seconds

    def load_latest(self) -> tuple[dict | None, str]:
        """(newest state that verifies and loads, 'local' | 'mirror' | 'none'): local first."""
        try:
            found, source = self.manager.load_newest(STATE, self.startup_timeout_s)
        except (DriveError, TimeoutError) as exc:
            # Safe to start over: a run is deterministic, so any state this run writes at step s has
            # the bytes of one the mirror may hold for step s; only the recomputation is lost.
            log.warning("no local state and the mirror cannot be read (%s): starting from step 0", exc)
            warnings.warn(f"no local state in {self.local_root} and the mirror cannot be read ({exc}); "
                          f"training starts from step 0 (a deterministic run: nothing it writes conflicts with "
                          f"what the mirror may hold)", stacklevel=2)
            return None, "start (mirror unreachable)"
        if found.damaged:
            listed = "; ".join(f"{d.name} ({d.side}: {d.reason})" for d in found.damaged[:3])
            warnings.warn(f"{len(found.damaged)} damaged checkpoint copies skipped: {listed}", stacklevel=2)
        return found.obj, source

    def mirror_status(self) -> MirrorStatus:
        return self.manager.mirror_status()

    def durability(self, local_step: int) -> Durability:
        """Where the newest state stands. With nothing queued by this process (a resume at the last step),
        the state it resumed from is the one the mirror holds once caught up (the mirror's resync copies
        a local one it lacks).
        """
        status = self.mirror_status()
        queued = self.manager.queued(STATE)
        if queued is None and STATE in self.manager.loaded:
            queued = self.manager.loaded[STATE][0]
            local_step = max(local_step, queued)
        if queued is None:
            queued = max(self.local.versions(STATE), default=None)
        return Durability(local_step, queued if self.manager.mirror else None, status.caught_up,
                          status.failing, status.last_error)

    def close(self, timeout: float | None = 30.0) -> Durability:
        """Join the local writer, flush the mirror for at most `timeout` s, stop both threads; what is durable
        where. A write that failed and was not raised yet (the run is ending on another error) is logged;
        the threads stop even when interrupted.
        """
        try:
            self.manager.close(timeout)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._guarded = self._hook = None
        return self.durability(max(self.local.versions(STATE), default=0))

    def _saved(self, name: str, path: Path) -> None:
        """Warn before the local disk or the mirror folder (Drive) runs out of room for what retention keeps."""
        from .ops import DiskWatch

        self._sizes[name] = path.stat().st_size
        if name != STATE:
            return
        if self.watch is None:
            folders = {"local disk": self.local_root}
            if self._mirror_dir is not None:
                folders["mirror"] = self._mirror_dir
            quota = {} if self.quota_bytes is None or self._mirror_dir is None else {"mirror": self.quota_bytes}
            self.watch = DiskWatch(folders, self.keep_last, quota_bytes=quota)
        self.watch.check(self._sizes[STATE], self._sizes.get(BEST, 0))


def optimizer_moments(optimizer) -> list:
    """The tensors of `optimizer`'s per-parameter state (moments, step counts): only its `step` edits them (its
    `load_state_dict` replaces them). Not its parameters: a forward (nn.Embedding's max_norm), an EMA, a clamp_,
    the model's load_state_dict or another optimizer edit those in place.
    """
    import torch

    return [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
