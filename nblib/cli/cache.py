"""`python -m nblib cache`: build, resume, verify or repair a sharded image or record cache."""
from __future__ import annotations

import argparse

from nblib.cli.args import finite_positive_float, parse_or_refuse, positive_int, seed_int
from nblib.config import CODECS
from nblib.errors import ConfigError, os_errors_name


def cache_main(argv: list[str]) -> int:
    """`python -m nblib cache`: build, resume, verify or repair a sharded image cache.

    Build or resume: `cache --texts PATH --out DIR [--size --shard-mb --codec --workers ...]`.
    Your own images: `cache --images PATH --out DIR [--size N]` (a folder of image files or of class
    subfolders, which give the labels, or `--labels FILE`; a Parquet file or an HF datasets folder,
    `--column` names the image column; `--size N` resizes: shorter side to N, then the centre crop);
    a saved HF dataset, Parquet or Arrow files with labels or texts: `cache --hf PATH --image-column C
    [--label-column L | --text-column T] --out DIR`; webdataset tars: `cache --wds 'shards-{000..009}.tar'
    --out DIR`.
    Records of tensors: `cache --records FILE --out DIR --shard-size-mb 400 [--group-by layer_id]`.
    Check: `cache --verify DIR`, fix: `cache --verify --repair DIR` (exit 0 OK, 1 problems found).
    """
    from nblib.cache import populate, verify
    from nblib.cache.record_format import is_record_folder
    from nblib.disk import refuse_overlap

    args = _cache_args(argv)
    refuse_overlap("cache", args.out, {"--texts": args.texts, "--images": args.images, "--labels": args.labels,
                                       "--hf": args.hf, "--records": args.records}, suffix="cache")
    folder = args.verify or args.folder
    if args.verify is not None or args.repair or args.folder:
        if not folder:
            raise ConfigError("--verify needs the cache folder: python -m nblib cache --verify DIR [--repair]")
        if args.records or is_record_folder(folder):
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
    with os_errors_name(args.out):
        summary = populate(args.texts, args.out, image_size=args.size or args.profile_size, shard_mb=args.shard_mb,
                           workers=args.workers, seed=args.seed, codec=args.codec,
                           overwrite=args.overwrite, progress=not args.no_progress,
                           field=args.field, errors=args.errors, strict_fonts=args.strict_fonts,
                           codec_level=args.codec_level)
    print(summary)
    return 0


def _cache_images(args: argparse.Namespace) -> int:
    """`cache --images PATH | --hf PATH | --wds PATTERN --out DIR`: your own images into a cache
    (nblib.cache.write_images), with the labels (class subfolders, --labels FILE, --hf, --wds) or texts in a
    side table.
    """
    from nblib.cache import write_images
    from nblib.cache.sources import hf_source, images_source, labels_line, wds_source

    flag = "--images" if args.images else "--hf" if args.hf else "--wds"
    if not args.out or args.texts or sum(bool(x) for x in (args.images, args.hf, args.wds)) > 1:
        raise ConfigError(f"{flag} needs --out DIR, and takes no --texts nor another of --images/--hf/--wds")
    if args.codec == "auto":
        raise ConfigError(f"--codec auto is for --texts; pick one of raw, zlib, zstd, png for {flag}")
    if (args.label_column or args.text_column) and not args.hf:
        raise ConfigError("--label-column and --text-column go with --hf (--wds reads cls/txt/json members)")
    if args.labels and not args.images:
        raise ConfigError("--labels FILE goes with --images DIR (--hf takes --label-column, --wds cls members)")
    if args.images:
        source = images_source(args.images, args.column, args.labels)
    elif args.hf:
        source = hf_source(args.hf, args.image_column or args.column or "image",
                           label_column=args.label_column, text_column=args.text_column)
    else:
        source = wds_source(args.wds)
    with os_errors_name(args.out):
        summary = write_images(source.images, args.out, shard_mb=args.shard_mb, codec=args.codec,
                               codec_level=args.codec_level, n_images=source.count, seed=args.seed,
                               overwrite=args.overwrite, progress=not args.no_progress,
                               keys=source.keys, side=source.side, size=args.size)
    print(summary)
    print(labels_line(source, args.out))
    return 0


def _cache_records(args: argparse.Namespace, verify_folder=None) -> int:
    """`cache --records FILE --out DIR [--shard-size-mb --group-by]`: record shards (nblib.cache.records)."""
    from nblib.cache.record_sources import record_source
    from nblib.cache.records import write_records
    from nblib.cache.verify import verify_records

    if verify_folder is not None:
        source = record_source(args.records, trust=args.trust_pickle) if args.records else None
        report = verify_records(verify_folder, repair=args.repair, records=source, trust=args.trust_pickle)
        print(report)
        return 0 if report.ok else 1
    if not args.out or args.texts or args.images:
        raise ConfigError("--records FILE needs --out DIR and neither --texts nor --images")
    source = record_source(args.records, trust=args.trust_pickle)
    with os_errors_name(args.out):
        summary = write_records(source, args.out, shard_mb=args.shard_mb, group_by=args.group_by,
                                codec=args.codec or "zstd", codec_level=args.codec_level, overwrite=args.overwrite)
    if "shape" in source.extra:
        print(f"--records {args.records}: {source.extra['shape']}")
    print(summary)
    return 0


def _cache_args(argv: list[str]) -> argparse.Namespace:
    """Parse `cache` flags; a bad value raises ConfigError (one `error:` line, exit 2)."""
    from nblib import config, env
    from nblib.cache.pixels import check_size

    defaults = config.for_profile(env.profile())
    p = argparse.ArgumentParser(prog="python -m nblib cache", description=cache_main.__doc__,
                                exit_on_error=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", help="text file (one text per line) or JSONL (see --field)")
    p.add_argument("--images", help="your own images instead of texts: a folder of image files, a "
                                    "Parquet file or an HF datasets folder (see --column)")
    p.add_argument("--column", default=None, help="with --images: the image column (default 'image')")
    p.add_argument("--labels", default=None, metavar="FILE",
                   help="with --images DIR: a CSV (file,label rows) or JSON ({file: label}) of the images' "
                        "labels (default: the class subfolders' names, if any)")
    p.add_argument("--hf", help="a local HF dataset (save_to_disk folder) or Parquet/Arrow file or folder")
    p.add_argument("--image-column", default=None, help="with --hf: the image column (default 'image')")
    p.add_argument("--label-column", default=None, help="with --hf: a class column (ClassLabel, ints or strings)")
    p.add_argument("--text-column", default=None, help="with --hf: a text (caption) column")
    p.add_argument("--wds", help="webdataset tars, brace-expanded: 'shards-{000..009}.tar'")
    p.add_argument("--records", help="records of tensors instead: a pickle (a stream of dumps, or one list, tuple or "
                                     "dict of records, any size, read one record at a time), .npz or .pt")
    p.add_argument("--group-by", default=None, help="with --records: a scalar field whose records share shards")
    p.add_argument("--trust-pickle", action="store_true",
                   help="with --records: import and run whatever the pickle names (only for your own files; "
                        "arrays, tensors and objects' fields are read without it)")
    p.add_argument("--codec-level", type=int, default=None,
                   help="compression level of zlib/png (0-9) or zstd (1-22; default 3)")
    p.add_argument("--out", help="cache folder to create or resume")
    p.add_argument("--size", type=positive_int, default=None,
                   help=f"image size in pixels: --texts renders at it (default: the profile's, "
                        f"{defaults.model.image_size}); --images/--hf/--wds resize every image to it, shorter "
                        f"side to N (bicubic), then the centre N x N crop (default: keep the images' one size)")
    p.add_argument("--shard-mb", "--shard-size-mb", dest="shard_mb", type=finite_positive_float,
                   default=float(defaults.run.shard_mb),
                   help="MB (10^6 bytes) per shard on disk; with --records at most this, header and tables "
                        "included (one larger record gets a shard alone), and RAM holds one record and its "
                        "payload (2-3x its bytes), not a shard (default %(default)s)")
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
    args = parse_or_refuse(p, argv)
    if args.folder and args.verify is None and not args.repair:
        raise ConfigError(f"unexpected argument {args.folder!r}; to check a cache use --verify DIR")
    check_size(args.size)                   # before any image or render buffer is allocated
    if args.codec is None and not args.records:
        args.codec = defaults.run.codec
    args.profile_size = defaults.model.image_size
    return args
