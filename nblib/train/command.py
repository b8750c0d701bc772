"""What `python -m nblib train` does once its flags are parsed: flags -> TrainConfig -> `train`.

The parser lives in `nblib.cli.train` (`_train_args`); this module checks the
paths, builds the config and runs the loop.

SIGTERM stops a run as Ctrl-C does (`SigtermStop`).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from nblib.cache.format import read_cache_manifest
from nblib.cache.record_format import read_record_manifest
from nblib.config import named_config
from nblib.errors import ConfigError, InputError

from .config import TrainConfig, backup_multiple

if TYPE_CHECKING:
    from .loop import TrainReport

log = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the same clean stop."""

    exit_status = 128 + signal.SIGTERM


class SigtermStop:
    """SIGTERM stops a run as Ctrl-C does: the writer joined, the loader's workers shut down, no traceback,
    exit status 143; rerun to resume.

    Without it SIGTERM killed the main process at once and its loader workers held the caller's pipes
    until their 5 s watchdog saw the parent gone (one printed a BrokenPipeError traceback when the
    parent died mid-batch). Between steps the first SIGTERM is acted on at the end of the step under
    way (its save done, no batch cut in half); before the first step it stops at once, and so does a
    second SIGTERM. Trade-off: the stop waits for one step (and its evaluation, when one is due).
    """

    def __init__(self):
        self.pending = self.stepping = False

    @contextlib.contextmanager
    def installed(self):
        """SIGTERM handled as above within (main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    @contextlib.contextmanager
    def workers_terminated(self):
        """Within: a loader worker killed by SIGTERM (the whole process group was sent it) stops the run
        as the main process's own SIGTERM does, instead of torch's RuntimeError and its traceback.
        """
        try:
            yield
        except RuntimeError as exc:
            if not self.worker_gone_by_sigterm(str(exc)):
                raise
            _stopping()
            raise Terminated("terminated (SIGTERM, to the loader's workers too)") from None

    def worker_gone_by_sigterm(self, error: str) -> bool:
        """Whether torch's loader error is a worker ended by the SIGTERM: its SIGCHLD handler names the signal;
        its poll of the worker queue says only "exited unexpectedly", so that counts once this process got one.
        """
        return "killed by signal: Terminated" in error or (
            self.pending and "DataLoader worker" in error and "exited unexpectedly" in error)

    def on_step(self, step: int, report) -> None:
        """train()'s per-step callback: stop here when a SIGTERM came during the step."""
        self.stepping = True
        if self.pending:
            self._stop()

    def _on_signal(self, signum, frame) -> None:
        if self.stepping and not self.pending:
            self.pending = True
            log.warning("SIGTERM: stopping after this step (send it again to stop at once)")
            return
        self._stop()

    def _stop(self):
        _stopping()
        raise Terminated("terminated (SIGTERM)")


def _stopping() -> None:
    """The stop finishes what it started: later SIGTERMs are ignored, and torch's SIGCHLD handler (which
    raises when a loader worker dies: they got the SIGTERM too) no longer fires while the loader shuts down.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def config_from_args(args) -> TrainConfig:
    """The TrainConfig the command line asks for. The default --backup-every follows --save-every (its nearest
    multiple below, said in one line); another --backup-every that is not a multiple is refused.
    """
    backup_every, default = args.backup_every, TrainConfig.backup_every     # the field's default
    if backup_every == default and backup_every % args.save_every:
        backup_every = backup_multiple(default, args.save_every)
        log.warning("backups every %d steps: the default --backup-every %d follows --save-every %d (a backup copies "
                    "a local save); pass --backup-every N, a multiple of %d, to choose", backup_every, default,
                    args.save_every, args.save_every)
    return TrainConfig(profile=args.profile, labels=args.labels, steps=args.steps, batch_size=args.batch_size,
                       accumulation=args.accumulation, lr=args.lr, precision=args.precision, device=args.device,
                       seed=args.seed, save_every=args.save_every, backup_every=backup_every,
                       keep_last=args.keep_last, eval_every=args.eval_every, best_metric=args.best_metric,
                       workers=args.workers)


def check_train_args(args):
    """The refusals a command line can get before torch is imported (~2 s): the paths, the knobs, the
    quota. (the RecordFields of --records or None, the mirror quota in bytes) when they pass.
    """
    records = args.records is not None
    fields = None if records else record_fields(args)    # --records' RecordFields imports torch: it comes last
    cache = Path(args.records if records else args.cache)
    if not records and not (cache / "manifest.json").is_file():
        raise InputError(f"--cache {cache} is not a cache folder (no manifest.json); build one with "
                         f"python -m nblib cache --texts data/sample_texts.jsonl --out {cache}")
    if records and not (cache / "manifest.json").is_file():
        raise InputError(f"--records {cache} is not a folder of record shards (no manifest.json); build one with "
                         f"python -m nblib cache --records FILE.pkl --out {cache} --shard-size-mb 400")
    if not records:
        check_image_size(cache, args.model, args.profile)
    else:
        read_record_manifest(cache)         # an image cache given to --records: one line naming --cache
    if args.val is not None:
        read_cache_manifest(args.val)       # missing, or record shards: one line naming what reads them
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers} is negative; use 0 (read in the main process) or more")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; pass a folder for the run")
    config_from_args(args)
    quota = mirror_quota_bytes(args.mirror, args.drive_quota_gb)
    return (record_fields(args) if records else fields), quota


def check_image_size(cache: Path, spec: str | None, profile: str) -> None:
    """The TRM takes images of its own size and does not resize: a cache of another size is refused here,
    before torch is imported, naming the cache command that builds one of the right size.
    """
    head, _, preset_name = (spec or "trm").partition(":")
    if head != "trm":
        return                              # another model: its preprocessing is checked when it loads
    size = named_config(preset_name or profile).model.image_size
    cached = int(read_cache_manifest(cache)["image_shape"][0])
    if cached != size:
        from nblib.config import PROFILES, preset_names

        model = f"--model {spec}" if preset_name else f"--profile {profile}"
        fits = [name for name in (*PROFILES, *preset_names()) if named_config(name).model.image_size == cached]
        other = f", or train with --profile {fits[0]} (a {cached} px TRM)" if fits else ""
        raise ConfigError(f"--cache {cache} holds {cached}x{cached} images, the TRM of {model} takes {size}x{size} "
                          f"and does not resize; build a cache at that size: python -m nblib cache --images DIR "
                          f"--size {size} --out NEW (or --texts FILE.jsonl --size {size}){other}")


def run_train(args, checked, world=None) -> TrainReport:
    """Train (or resume) as the flags say, once `check_train_args` passed them (`checked`, what it returned);
    SIGTERM stops it as Ctrl-C does.
    """
    fields, quota = checked
    cache = Path(args.cache if fields is None else args.records)
    from .loop import train

    with SigtermStop().installed() as stop, stop.workers_terminated():
        return train(cache, Path(args.out), config_from_args(args), mirror=args.mirror, texts=args.texts,
                     progress=not args.no_progress, world=world, mirror_timeout_s=args.mirror_timeout,
                     sync_save=args.sync_save, on_step=stop.on_step, mirror_quota_bytes=quota,
                     model=args.model, output=args.output, weights=args.weights, fields=fields, val=args.val)


def record_fields(args):
    """The RecordFields `--records` asks for (None for an image cache); ConfigError for a flag of the other kind."""
    record_flags = {"--input-key": args.input_key, "--target-key": args.target_key, "--classes": args.classes,
                    "--loss": None if args.loss == "auto" else args.loss}
    if args.records is None:
        given = [flag for flag, value in record_flags.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} go with --records (record shards); an image cache (--cache) "
                              f"trains on its labels: drop them, or pass --records DIR")
        return None
    from .records import RecordFields

    return RecordFields(args.input_key, args.target_key, args.loss, args.classes)


def mirror_quota_bytes(mirror: str | None, quota_gb: float | None) -> int | None:
    """The quota the disk watch counts the mirror folder against: `quota_gb` when given, the free Google
    quota (15 GB) for a folder under the Colab Drive mount, else none. Refused without a mirror folder.
    """
    from nblib.budget.drive import FREE_QUOTA_GB
    from nblib.env import on_google_drive
    from nblib.units import GB

    from .objstore import is_url

    if quota_gb is not None and (mirror is None or is_url(mirror)):
        where = "no --mirror" if mirror is None else f"--mirror {mirror} (object storage bills by use, no quota)"
        raise ConfigError(f"--drive-quota-gb {quota_gb:g} applies to a mirror folder (Google Drive), but the run "
                          f"has {where}; drop --drive-quota-gb or pass --mirror /content/drive/MyDrive/RUN")
    if quota_gb is not None:
        return int(quota_gb * GB)
    if mirror is not None and not is_url(mirror) and on_google_drive(Path(mirror)):
        return int(FREE_QUOTA_GB * GB)
    return None
