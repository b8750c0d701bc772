"""The command line: every `python -m nblib <verb>`; each verb calls the same function a notebook does.

Verbs: info, budget, cache, encode, train, suite, pipeline, export. A user-facing failure (an NblibError) prints one
line, `error: ...`, and exits 2; so does an OSError (full disk, read-only folder, a path that is
a file), with the path, what the error means and what to do. No traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys

from nblib.config import SEED_LIMIT
from nblib.errors import NblibError


def main(argv: list[str] | None = None) -> int:
    """Dispatch `python -m nblib <verb> ...`; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in VERBS:
        print(f"usage: python -m nblib {{{','.join(VERBS)}}} [options]\n"
              f"       python -m nblib <verb> --help", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return int(VERBS[argv[0]](argv[1:]) or 0)
    except NblibError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:      # Ctrl-C, or SIGTERM where a verb stops on it (train)
        print(f"{str(exc) or 'interrupted'}; rerun the same command to resume", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError: the path, what the errno means, and what to do."""
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    where = exc.filename if exc.filename is not None else "a file"
    advice = {
        errno.ENOSPC: "free space on that disk (or point the output elsewhere), then rerun the "
                      "same command: finished work is kept and resumed",
        errno.EDQUOT: "free quota on that disk, then rerun the same command to resume",
        errno.EROFS: "that file system is read-only: choose a writable folder",
        errno.EACCES: "you may not write there: choose a folder you own, or fix its permissions",
        errno.EPERM: "you may not write there: choose a folder you own, or fix its permissions",
        errno.ENOTDIR: "a path that should be a folder is a file: choose a folder",
        errno.EISDIR: "a path that should be a file is a folder: choose a file",
        errno.ENOENT: "it does not exist: check the path",
        errno.ENOTCONN: "the mount is disconnected (Drive): remount it, then rerun to resume",
        errno.EIO: "an I/O error: check the disk or mount, then rerun to resume",
    }.get(exc.errno, "fix the cause, then rerun the same command to resume")
    return f"{where}: {what} (errno {exc.errno}); {advice}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def finite_positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (refuses inf and nan)."""
    value = float(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value




def seed_int(text: str) -> int:
    """argparse type: a seed, an integer in [0, 2**64)."""
    value = int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text:.40} is not a seed: use an integer from 0 to 2**64 - 1 "
                                         f"({SEED_LIMIT - 1:,})")
    return value


def bounded_float(low: float, high: float, unit: str):
    """argparse type: a finite number in [low, high] (refuses inf, nan and absurd magnitudes)."""
    def parse(text: str) -> float:
        value = float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text:.40} is not a number from {low:g} to {high:g} {unit}")
        return value
    return parse


def parse_or_refuse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse flags; a bad value is a ConfigError (one `error:` line, exit 2), not argparse's usage dump."""
    from nblib.errors import ConfigError

    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{exc}; see {parser.prog} --help") from None


# ---------------------------------------------------------------------------------------- info
def info_main(argv: list[str]) -> int:
    """`python -m nblib info`: runtime, profile, workspace folders and the hardware report."""
    from nblib.env import hardware_report, profile, runtime, workspace

    parser = argparse.ArgumentParser(prog="python -m nblib info", description=info_main.__doc__)
    parser.parse_args(argv)
    ws = workspace()
    print(f"runtime  {runtime()}\nprofile  {profile()}")
    for name, folder in ws.as_dict().items():
        print(f"{name:<9}{folder}")
    print(hardware_report(drive=ws.drive, local=ws.local))
    return 0


# -------------------------------------------------------------------------------------- budget
def budget_main(argv: list[str]) -> int:
    """`python -m nblib budget`: print a config's budget, its plan, or the reference table."""
    from nblib.budget import DEVICES, max_batch_size, plan_budget, predict_budget
    from nblib.config import preset
    from nblib.sdpa import SDPA_BACKENDS

    p = argparse.ArgumentParser(prog="python -m nblib budget", description=budget_main.__doc__, exit_on_error=False)
    p.add_argument("--preset", default="seed_t4")
    p.add_argument("--device", default="t4", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--n-samples", type=int)
    p.add_argument("--dtype", choices=("float16", "float32"))
    p.add_argument("--outputs", help="comma-separated subset of sketches,checksums,children")
    p.add_argument("--sdpa", choices=SDPA_BACKENDS)
    p.add_argument("--drive-quota-gb", type=finite_positive_float, default=15.0)
    p.add_argument("--plan", action="store_true", help="recommend knobs that fit")
    p.add_argument("--texts", help="your texts (file or JSONL): the verdict and the plan measure the cache's bytes "
                                   "per image on a few hundred of them (default: the reference analysis' ratios)")
    p.add_argument("--reference", action="store_true", help="reference analysis vs this suite")
    p.add_argument("--model", help="budget this model's VRAM from a trace of its own code (trm, hf:CLASS, "
                                   "hf:CLASS:config.json, timm:NAME, package.module:factory)")
    p.add_argument("--weights", help="a state-dict file for --model")
    p.add_argument("--train", action="store_true", help="with --model: a training step, not encoding")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--json", action="store_true", help="with --model: print the budget as JSON (bytes)")
    args = parse_or_refuse(p, argv)
    if args.model:
        return _model_budget(args)
    if args.reference:
        from nblib.lab.memory_budgeting import reference_table

        print(reference_table(args.device))
        return 0
    changes = {k: v for k, v in (("batch_size", args.batch_size), ("n_samples", args.n_samples),
                                 ("out_dtype", args.dtype)) if v is not None}
    if args.outputs:
        changes["outputs"] = tuple(o.strip() for o in args.outputs.split(","))
    cfg = preset(args.preset).replace(**changes)
    kwargs = {"drive_quota_gb": args.drive_quota_gb, "sdpa_backend": args.sdpa}
    sizes = None
    if args.texts:               # the verdict and the plan size the cache by the same measurement
        from nblib.codec_sizes import codec_sizes

        sizes = codec_sizes(args.texts, cfg.model.image_size)
        print(sizes)
    print(predict_budget(cfg, args.device, codec_sizes=sizes, **kwargs).table())
    print(f"max batch size on {args.device}: {max_batch_size(cfg, args.device, **kwargs)}")
    if args.plan:
        print(plan_budget(cfg, args.device, codec_sizes=sizes, **kwargs))
    return 0


def _model_budget(args: argparse.Namespace) -> int:
    """`budget --model`: the traced VRAM lines and the largest batch that fits (nblib.budget.model_vram)."""
    import json

    from nblib.budget.model_vram import model_vram

    model = args.model
    if args.weights:
        from nblib.models import load_model

        model = load_model(args.model, args.weights)
    budget = model_vram(model, args.batch_size or 64, args.device, precision=args.precision, train=args.train)
    print(json.dumps(budget.as_json(), indent=1) if args.json else budget.table())
    budget.refuse_if_over()
    return 0


# --------------------------------------------------------------------------------------- cache
def cache_main(argv: list[str]) -> int:
    """`python -m nblib cache`: build, resume, verify or repair a sharded image cache.

    Build or resume: `cache --texts PATH --out DIR [--size --shard-mb --codec --workers ...]`.
    Your own images: `cache --images PATH --out DIR` (a folder of image files, a Parquet file or an
    HF datasets folder; `--column` names the image column); a saved HF dataset, Parquet or Arrow
    files with labels or texts: `cache --hf PATH --image-column C [--label-column L | --text-column T]
    --out DIR`; webdataset tars: `cache --wds 'shards-{000..009}.tar' --out DIR`.
    Records of tensors: `cache --records FILE --out DIR --shard-size-mb 400 [--group-by layer_id]`.
    Check: `cache --verify DIR`, fix: `cache --verify --repair DIR` (exit 0 OK, 1 problems found).
    """
    from nblib.cache import populate, verify
    from nblib.errors import ConfigError

    args = _cache_args(argv)
    folder = args.verify or args.folder
    if args.verify is not None or args.repair or args.folder:
        if not folder:
            raise ConfigError("--verify needs the cache folder: python -m nblib cache --verify DIR [--repair]")
        if args.records or _is_record_folder(folder):
            return _cache_records(args, verify_folder=folder)
        report = verify(folder, repair=args.repair, texts=args.texts, field=args.field, workers=args.workers)
        print(report)
        return 0 if report.ok else 1
    if args.images or args.hf or args.wds:
        return _cache_images(args)
    if args.records:
        return _cache_records(args)
    if not args.texts or not args.out:
        raise ConfigError("building a cache needs --texts PATH (or --images PATH) and --out DIR (or check "
                          "one with --verify DIR)")
    with _os_errors_name(args.out):
        summary = populate(args.texts, args.out, image_size=args.size, shard_mb=args.shard_mb,
                           workers=args.workers, seed=args.seed, codec=args.codec,
                           overwrite=args.overwrite, progress=not args.no_progress,
                           field=args.field, errors=args.errors, strict_fonts=args.strict_fonts,
                           codec_level=args.codec_level)
    print(summary)
    return 0


def _cache_images(args: argparse.Namespace) -> int:
    """`cache --images PATH | --hf PATH | --wds PATTERN --out DIR`: your own images into a cache
    (nblib.cache.write_images), with the labels or texts of --hf and --wds in a side table.
    """
    from nblib.cache import image_source, write_images
    from nblib.cache.images import image_keys
    from nblib.cache.sources import ImageSource, hf_source, wds_source
    from nblib.errors import ConfigError

    flag = "--images" if args.images else "--hf" if args.hf else "--wds"
    if not args.out or args.texts or sum(bool(x) for x in (args.images, args.hf, args.wds)) > 1:
        raise ConfigError(f"{flag} needs --out DIR, and takes no --texts nor another of --images/--hf/--wds")
    if args.codec == "auto":
        raise ConfigError(f"--codec auto is for --texts; pick one of raw, zlib, zstd, png for {flag}")
    if (args.label_column or args.text_column) and not args.hf:
        raise ConfigError("--label-column and --text-column go with --hf (--wds reads cls/txt/json members)")
    if args.images:
        images, count = image_source(args.images, args.column)
        source = ImageSource(images=iter(images), count=count, keys=image_keys(args.images))
    elif args.hf:
        source = hf_source(args.hf, args.image_column or args.column or "image",
                           label_column=args.label_column, text_column=args.text_column)
    else:
        source = wds_source(args.wds)
    with _os_errors_name(args.out):
        summary = write_images(source.images, args.out, shard_mb=args.shard_mb, codec=args.codec,
                               codec_level=args.codec_level, n_images=source.count, seed=args.seed,
                               overwrite=args.overwrite, progress=not args.no_progress,
                               keys=source.keys, side=source.side)
    print(summary)
    return 0


def _is_record_folder(folder) -> bool:
    from nblib.cache.record_format import is_record_folder

    return is_record_folder(folder)


def _cache_records(args: argparse.Namespace, verify_folder=None) -> int:
    """`cache --records FILE --out DIR [--shard-size-mb --group-by]`: record shards (nblib.cache.records)."""
    from nblib.cache.record_sources import record_source
    from nblib.cache.record_verify import verify_records
    from nblib.cache.records import write_records
    from nblib.errors import ConfigError

    if verify_folder is not None:
        source = record_source(args.records, trust=args.trust_pickle) if args.records else None
        report = verify_records(verify_folder, repair=args.repair, records=source, trust=args.trust_pickle)
        print(report)
        return 0 if report.ok else 1
    if not args.out or args.texts or args.images:
        raise ConfigError("--records FILE needs --out DIR and neither --texts nor --images")
    source = record_source(args.records, trust=args.trust_pickle)
    with _os_errors_name(args.out):
        summary = write_records(source, args.out, shard_mb=args.shard_mb, group_by=args.group_by,
                                codec=args.codec or "zstd", codec_level=args.codec_level, overwrite=args.overwrite)
    print(summary)
    return 0


@contextlib.contextmanager
def _os_errors_name(folder):
    """An OSError that names no path (a write into an open file: ENOSPC) names the output folder."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, NblibError) or exc.filename is not None or not exc.errno:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno), str(folder)) from exc


def _cache_args(argv: list[str]) -> argparse.Namespace:
    """Parse `cache` flags; a bad value raises ConfigError (one `error:` line, exit 2)."""
    from nblib import config, env
    from nblib.config import CODECS
    from nblib.errors import ConfigError

    defaults = config.for_profile(env.profile())
    p = argparse.ArgumentParser(prog="python -m nblib cache", description=cache_main.__doc__,
                                exit_on_error=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", help="text file (one text per line) or JSONL (see --field)")
    p.add_argument("--images", help="your own images instead of texts: a folder of image files, a "
                                    "Parquet file or an HF datasets folder (see --column)")
    p.add_argument("--column", default=None, help="with --images: the image column (default 'image')")
    p.add_argument("--hf", help="a local HF dataset (save_to_disk folder) or Parquet/Arrow file or folder")
    p.add_argument("--image-column", default=None, help="with --hf: the image column (default 'image')")
    p.add_argument("--label-column", default=None, help="with --hf: a class column (ClassLabel, ints or strings)")
    p.add_argument("--text-column", default=None, help="with --hf: a text (caption) column")
    p.add_argument("--wds", help="webdataset tars, brace-expanded: 'shards-{000..009}.tar'")
    p.add_argument("--records", help="records of tensors instead: a pickle stream, a pickled list, .npz or .pt")
    p.add_argument("--group-by", default=None, help="with --records: a scalar field whose records share shards")
    p.add_argument("--trust-pickle", action="store_true",
                   help="with --records: unpickle any class the file names (only for your own files)")
    p.add_argument("--codec-level", type=int, default=None,
                   help="compression level of zlib/png (0-9) or zstd (1-22; default 3)")
    p.add_argument("--out", help="cache folder to create or resume")
    p.add_argument("--size", type=positive_int, default=defaults.model.image_size,
                   help="image size in pixels (default: the profile's, %(default)s)")
    p.add_argument("--shard-mb", "--shard-size-mb", dest="shard_mb", type=finite_positive_float,
                   default=float(defaults.run.shard_mb),
                   help="target stored MB per shard (default %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="render processes (default: all cores)")
    p.add_argument("--field", default=None, help="JSONL field holding the text (default 'text' for .jsonl)")
    p.add_argument("--codec", default=None, choices=(*CODECS, "auto"),
                   help=f"shard format; auto lets the disk budget pick (default {defaults.run.codec}; "
                        f"zstd for --records)")
    p.add_argument("--seed", type=seed_int, default=defaults.run.seed)
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="invalid UTF-8 in --texts: refuse (strict) or replace with U+FFFD")
    p.add_argument("--overwrite", action="store_true",
                   help="rebuild a cache that was made from other texts or settings")
    p.add_argument("--strict-fonts", action="store_true",
                   help="refuse texts with over 1%% of characters lacking a glyph (default: warn)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verify", metavar="DIR", nargs="?", const="",
                   help="check a cache instead of building one (DIR here or after the flags)")
    p.add_argument("--repair", action="store_true", help="with --verify: fix what is wrong")
    p.add_argument("folder", nargs="?", help=argparse.SUPPRESS)
    try:
        args = p.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{exc}; see python -m nblib cache --help") from None
    if args.folder and args.verify is None and not args.repair:
        raise ConfigError(f"unexpected argument {args.folder!r}; to check a cache use --verify DIR")
    if args.codec is None and not args.records:
        args.codec = defaults.run.codec
    return args


# -------------------------------------------------------------------------------------- encode
def encode_main(argv: list[str]) -> int:
    """`python -m nblib encode`: stream the encoder over a cache into durable, resumable parts."""
    from nblib import env
    from nblib.cache import ShardedImageCache
    from nblib.encode import VerifyLevel, encode
    from nblib.encode.distributed import join

    args = parse_or_refuse(_encode_parser(), argv)
    config = _encode_config(args, env.profile())
    world = join(shard=args.shard, consolidate_only=args.consolidate, device=args.device)  # torchrun ranks too
    try:
        with _os_errors_name(args.out):
            report = encode(ShardedImageCache(args.cache), args.out, config, device=world.device,
                            mirror_dir=args.mirror, progress=not args.no_progress, offload=args.offload,
                            weights=args.weights, model=args.model, outputs=_encode_outputs(args),
                            preflight=not args.no_preflight, world=world,
                            verify=VerifyLevel.HASH if args.verify else VerifyLevel.STAT,
                            precision=args.precision, reencode_numerics=args.reencode_numerics)
    finally:
        world.close()
    if world.reports:   # the other ranks of a launch stay quiet
        print(report)
    return 0


def _encode_parser() -> argparse.ArgumentParser:
    from nblib.config import OUTPUT_DTYPES, OUTPUT_NAMES
    from nblib.encode import OFFLOAD_MODES
    from nblib.encode.numerics import PRECISIONS

    p = argparse.ArgumentParser(prog="python -m nblib encode", description=encode_main.__doc__,
                                exit_on_error=False)
    p.add_argument("--cache", required=True, help="folder of a ShardedImageCache")
    p.add_argument("--out", required=True, help="run folder: parts, manifest, consolidated .npy")
    p.add_argument("--profile", help="smoke | t4 | full, or a preset name (default: NBLIB_PROFILE)")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--checkpoint-every", type=positive_int, help="batches per durable part")
    p.add_argument("--outputs", help=f"comma-separated outputs to store: of the TRM {','.join(OUTPUT_NAMES)}; "
                   f"of another model, the names its forward returns (default: all)")
    p.add_argument("--dtype", choices=OUTPUT_DTYPES, help="dtype of the stored outputs")
    p.add_argument("--mirror", help="durable mirror folder (e.g. on Google Drive)")
    p.add_argument("--model", help="trm (default), trm:PRESET, hf:CLASS, hf:CLASS:config.json, timm:NAME or "
                   "package.module:factory; built with seeded random weights, nothing downloaded")
    p.add_argument("--weights", help="a state-dict file (safetensors or torch) loaded strictly over the model")
    p.add_argument("--seed", type=seed_int, help="seed of the initial weights")
    p.add_argument("--workers", type=int, help="DataLoader worker processes (0: read in the main one)")
    p.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    p.add_argument("--offload", choices=OFFLOAD_MODES, default="async")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="encoder precision: auto (fp16 autocast on CUDA, fp32 on CPU), fp32, fp16, bf16")
    p.add_argument("--reencode-numerics", action="store_true",
                   help="on a resume with another device, precision or torch: encode again the parts made "
                        "with the other numerics (default: refuse, naming the change)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-preflight", action="store_true", help="skip the budget check")
    p.add_argument("--verify", action="store_true", help="hash every durable part before resuming (default: "
                   "metadata only; consolidation hashes every part it reads anyway)")
    p.add_argument("--shard", metavar="I/N", help="encode part set I of N (machines sharing only --out); "
                   "then run --consolidate once")
    p.add_argument("--consolidate", action="store_true", help="only merge the parts the shards wrote; "
                   "names the missing parts and shards")
    return p


def _encode_config(args: argparse.Namespace, default_profile: str):
    """The profile's (or preset's) config with the flags given applied."""
    import math

    from nblib.config import for_profile, preset
    from nblib.errors import ConfigError

    name = args.profile or default_profile
    try:
        config = for_profile(name)
    except ConfigError:
        config = preset(name)
    changes = {}
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.checkpoint_every is not None:
        changes["checkpoint_every"] = args.checkpoint_every
        changes["consolidate_every"] = math.gcd(args.checkpoint_every, config.run.consolidate_every)
    if args.dtype:
        changes["out_dtype"] = args.dtype
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.workers is not None:
        changes["workers"] = args.workers
    return config.replace(**changes) if changes else config


def _encode_outputs(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The --outputs names (None: the TRM's configured ones, or all another model returns)."""
    if not args.outputs:
        return None
    return tuple(o.strip() for o in args.outputs.split(",") if o.strip())


# --------------------------------------------------------------------------------------- train
def train_main(argv: list[str]) -> int:
    """`python -m nblib train`: train a model on a cache's labels or on record shards; rerunning it resumes."""
    from nblib.train.command import check_train_args, run_train

    args = _train_args(argv)
    checked = check_train_args(args)       # a refusal answers before torch is imported
    from nblib.encode.distributed import join

    world = join(device=args.device)
    try:
        with _os_errors_name(args.out):
            report = run_train(args, checked, world if world.size > 1 else None)
        # every rank waits for rank 0's last write before the process group closes: a rank that tore
        # gloo down while another still ran died in std::terminate at exit
        world.barrier("the end of training")
    finally:
        world.close()
    if world.rank == 0:
        print(report)
    return 0


def _train_args(argv: list[str]) -> argparse.Namespace:
    from nblib.errors import ConfigError
    from nblib.train.config import LABELS, METRICS, PRECISIONS
    from nblib.train.device import require_device

    p = argparse.ArgumentParser(prog="python -m nblib train", description=train_main.__doc__, exit_on_error=False)
    p.add_argument("--cache", help="folder of a ShardedImageCache with labels (a .jsonl's texts, or a side table)")
    p.add_argument("--records", help="instead of --cache: record shards (cache --records); needs --input-key and "
                                     "--target-key")
    p.add_argument("--input-key", help="with --records: the array field the model takes")
    p.add_argument("--target-key", help="with --records: the field the loss compares the output with")
    p.add_argument("--loss", choices=("auto", "ce", "mse"), default="auto",
                   help="with --records: ce (class labels or probability rows), mse; auto: ce for integer targets")
    p.add_argument("--classes", type=positive_int, help="with --records, integer targets and no --model: classes")
    p.add_argument("--model", help="trm (default for --cache), trm:PRESET, hf:CLASS[:config.json], timm:NAME or "
                                   "package.module:factory; with --records default: a per-token linear map")
    p.add_argument("--output", help="the model output its head (with --records: its loss) takes (default: logits, "
                                    "else pooler_output, else the first)")
    p.add_argument("--weights", help="a state-dict file (safetensors or torch) the model starts from")
    p.add_argument("--out", help="run folder; rerun with the same folder to resume (required)")
    p.add_argument("--steps", type=positive_int, help="optimizer steps in all (required)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="global batch (default %(default)s)")
    p.add_argument("--accumulation", type=positive_int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--lr", type=finite_positive_float, default=2e-3)
    p.add_argument("--mirror", help="durable copy: a folder (Google Drive) or an fsspec URL (s3://bucket/prefix)")
    p.add_argument("--profile", default="smoke", help="encoder shape: smoke | t4 | full or a preset (default smoke)")
    p.add_argument("--labels", choices=LABELS, default="kind")
    p.add_argument("--texts", help="the .jsonl the cache was rendered from (default: the path its manifest records)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when a GPU is present, else cpu)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    p.add_argument("--save-every", type=positive_int, default=5, help="local checkpoint interval, steps")
    p.add_argument("--backup-every", type=positive_int, default=10, help="mirror interval, steps")
    p.add_argument("--keep-last", type=positive_int, default=3, help="states kept on each side")
    p.add_argument("--eval-every", type=positive_int, default=10)
    p.add_argument("--best-metric", choices=METRICS, default="heldout_loss")
    p.add_argument("--mirror-timeout", type=finite_positive_float, default=60.0,
                   help="seconds to wait at the end for the mirror to catch up (never blocks training)")
    p.add_argument("--drive-quota-gb", type=finite_positive_float,
                   help="the mirror folder's quota in GB, for the disk watch (default: the free 15 GB when the "
                        "mirror is under the Colab Drive mount, else none; needs a mirror folder)")
    p.add_argument("--sync-save", action="store_true",
                   help="write each state on the training thread (default: snapshot, then a background write)")
    p.add_argument("--no-progress", action="store_true")
    try:
        args = p.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{exc}; see python -m nblib train --help") from None
    data = "records" if args.records is not None else "cache"
    needs = ("out", "steps", "input_key", "target_key") if data == "records" else ("cache", "out", "steps")
    missing = [f"--{name.replace('_', '-')}" for name in needs if getattr(args, name) is None]
    if missing or (args.cache is not None and args.records is not None):
        raise ConfigError(f"train needs {', '.join(missing) or 'one of --cache and --records'}: python -m nblib "
                          f"train --cache CACHE (or --records DIR --input-key X --target-key Y) --out RUN --steps N "
                          f"[--model SPEC] [--batch-size B] [--seed S] [--mirror DIR_OR_URL]")
    args.device = require_device(args.device)    # before any rank joins: one error line, not a CUDA traceback
    return args


# --------------------------------------------------------------------------------------- suite
def suite_main(argv: list[str]) -> int:
    """`python -m nblib suite`: run every notebook headless and print the summary table."""
    from nblib import env
    from nblib.suite import format_table, run_suite

    parser = argparse.ArgumentParser(prog="python -m nblib suite", description=suite_main.__doc__)
    parser.add_argument("--notebooks", default=None, help="folder of NN_*.ipynb (default notebooks/)")
    parser.add_argument("--out", default=None, help="executed copies go here (default outputs/notebooks)")
    parser.add_argument("--inactivity-s", type=float, default=None,
                        help="fail a notebook whose kernel sends nothing for this long (default "
                             "NBLIB_SUITE_INACTIVITY_S, else 300)")
    args = parser.parse_args(argv)
    print(f"profile: {env.profile()}   outputs: {env.outputs_dir()}", flush=True)
    results = run_suite(args.notebooks, args.out, inactivity_s=args.inactivity_s)
    print(format_table(results))
    failed = [r for r in results if r.status != "ok"]
    for r in failed:
        print(f"FAILED {r.name}: {r.error}")
    if not results:
        print("no notebooks found")
        return 1
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ pipeline
def pipeline_main(argv: list[str]) -> int:
    """`python -m nblib pipeline`: sweep DataLoader knobs over a cache; print the table and the pick under a RAM cap."""
    from nblib.cache import ShardedImageCache
    from nblib.lab.input_pipeline import TORCH_GRID, device_step, torch_sweep
    from nblib.pipeline import recommend
    from nblib.units import GB

    p = argparse.ArgumentParser(prog="python -m nblib pipeline", description=pipeline_main.__doc__,
                                exit_on_error=False)
    p.add_argument("--cache", required=True, help="folder of a ShardedImageCache")
    p.add_argument("--rss-cap-gb", type=finite_positive_float, required=True,
                   help="peak RAM (this process + its workers) a config may take, in GB")
    p.add_argument("--steps", type=positive_int, default=20, help="batches timed per config (default %(default)s)")
    p.add_argument("--per-sample-ms", type=bounded_float(0, 60_000, "ms"), default=0.25,
                   help="stand-in device step per image, in ms (default %(default)s: a 4,000 images/s device)")
    args = parse_or_refuse(p, argv)
    cache = ShardedImageCache(args.cache)
    print(f"sweeping {cache!r}: {', '.join(f'{k} {v}' for k, v in TORCH_GRID.items())}", flush=True)
    table = torch_sweep(cache, TORCH_GRID, consumer=device_step(args.per_sample_ms), steps=args.steps)
    print(table)
    print(f"recommended: {recommend(table, args.rss_cap_gb * GB)}")
    return 0


# --------------------------------------------------------------------------------------- export
def export_main(argv: list[str]) -> int:
    """`python -m nblib export`: a cache, or an encode run's outputs, to Parquet or an HF datasets folder.

    A cache: `export --cache DIR --out DIR [--format parquet|hf] [--texts PATH]` (one file per shard;
    each row carries its text, or its image file's name). Outputs: `export --outputs DIR --out DIR
    [--texts PATH] [--format parquet|hf]` (row-aligned with the texts). `--compression-level` sets
    Parquet's zstd level (1-22). A killed export resumes when the same command is rerun; until it
    completes, no file is in the folder for a reader to take. A folder holding files the export
    did not write is refused (see --overwrite); nothing nblib did not write is ever deleted.
    """
    from nblib.errors import ConfigError
    from nblib.export import FORMATS, export_cache, export_outputs

    p = argparse.ArgumentParser(prog="python -m nblib export", description=export_main.__doc__,
                                exit_on_error=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", help="a cache folder to export")
    p.add_argument("--outputs", help="an encode run's consolidated outputs folder to export")
    p.add_argument("--texts", help="the texts (adds a text column; for --cache, when the cache was built "
                                   "from a list or its texts moved)")
    p.add_argument("--field", default=None, help="JSONL field holding the text")
    p.add_argument("--out", help="export folder to create or resume")
    p.add_argument("--format", default="parquet", choices=FORMATS)
    p.add_argument("--compression-level", type=int, default=None,
                   help="Parquet zstd level, 1-22 (default: pyarrow's; 19 is smaller and slower)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an nblib export of something else (deleting only the files its manifest "
                        "lists), or write into a folder that holds other files (left untouched)")
    try:
        args = p.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{exc}; see python -m nblib export --help") from None
    if not args.out or bool(args.cache) == bool(args.outputs):
        raise ConfigError("export needs --out DIR and one of --cache DIR or --outputs DIR")
    common = {"texts": args.texts, "field": args.field, "compression_level": args.compression_level,
              "overwrite": args.overwrite}
    with _os_errors_name(args.out):
        if args.cache:
            summary = export_cache(args.cache, args.out, args.format, **common)
        else:
            summary = export_outputs(args.outputs, args.out, args.format, **common)
    print(summary)
    return 0


VERBS = {
    "info": info_main,
    "budget": budget_main,
    "cache": cache_main,
    "encode": encode_main,
    "train": train_main,
    "suite": suite_main,
    "pipeline": pipeline_main,
    "export": export_main,
}
