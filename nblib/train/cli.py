"""`python -m nblib train`'s flags -> TrainConfig -> `train` (the parser lives in nblib.cli)."""
from __future__ import annotations

from pathlib import Path

from nblib.errors import ConfigError, InputError

from .config import TrainConfig
from .loop import TrainReport, train


def config_from_args(args) -> TrainConfig:
    """The TrainConfig the command line asks for."""
    return TrainConfig(profile=args.profile, labels=args.labels, steps=args.steps, batch_size=args.batch_size,
                       accumulation=args.accumulation, lr=args.lr, precision=args.precision, device=args.device,
                       seed=args.seed, save_every=args.save_every, backup_every=args.backup_every,
                       keep_last=args.keep_last, eval_every=args.eval_every, best_metric=args.best_metric,
                       workers=args.workers)


def run_train(args, world=None) -> TrainReport:
    """Check the paths, then train (or resume) as the flags say."""
    cache = Path(args.cache)
    if not (cache / "manifest.json").is_file():
        raise InputError(f"--cache {cache} is not a cache folder (no manifest.json); build one with "
                         f"python -m nblib cache --texts data/sample_texts.jsonl --out {cache}")
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers} is negative; use 0 (read in the main process) or more")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; pass a folder for the run")
    return train(cache, out, config_from_args(args), mirror=args.mirror, texts=args.texts,
                 progress=not args.no_progress, world=world, mirror_timeout_s=args.mirror_timeout,
                 sync_save=args.sync_save, mirror_quota_bytes=mirror_quota_bytes(args.mirror, args.drive_quota_gb))


def mirror_quota_bytes(mirror: str | None, quota_gb: float | None) -> int | None:
    """The quota the disk watch counts the mirror folder against: `quota_gb` when given, the free Google
    quota (15 GB) for a folder under the Colab Drive mount, else none. Refused without a mirror folder.
    """
    from nblib.budget.drive import FREE_QUOTA_GB
    from nblib.budget.preflight import _on_google_drive

    from .objstore import is_url
    from .ops import drive_quota_bytes

    if quota_gb is not None and (mirror is None or is_url(mirror)):
        where = "no --mirror" if mirror is None else f"--mirror {mirror} (object storage bills by use, no quota)"
        raise ConfigError(f"--drive-quota-gb {quota_gb:g} applies to a mirror folder (Google Drive), but the run "
                          f"has {where}; drop --drive-quota-gb or pass --mirror /content/drive/MyDrive/RUN")
    if quota_gb is not None:
        return drive_quota_bytes(quota_gb)
    if mirror is not None and not is_url(mirror) and _on_google_drive(Path(mirror)):
        return drive_quota_bytes(FREE_QUOTA_GB)
    return None
