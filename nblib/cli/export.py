"""`python -m nblib export`: a cache or encode outputs to other formats."""
from __future__ import annotations

import argparse

from nblib.cli.args import parse_or_refuse
from nblib.errors import ConfigError, os_errors_name


def export_main(argv: list[str]) -> int:
    """`python -m nblib export`: a cache, or an encode run's outputs, to Parquet or an HF datasets folder.

    A cache: `export --cache DIR --out DIR [--format parquet|hf] [--texts PATH]` (one file per shard;
    each row carries its text, or its image file's name). Outputs: `export --outputs DIR --out DIR
    [--texts PATH] [--format parquet|hf]` (row-aligned with the texts). `--compression-level` sets
    Parquet's zstd level (1-22). A killed export resumes when the same command is rerun; until it
    completes, no file is in the folder for a reader to take. A folder holding files the export
    did not write is refused (see --overwrite); nothing nblib did not write is ever deleted.
    """
    from nblib.disk import refuse_overlap
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
    args = parse_or_refuse(p, argv)
    if not args.out or bool(args.cache) == bool(args.outputs):
        raise ConfigError("export needs --out DIR and one of --cache DIR or --outputs DIR")
    refuse_overlap("export", args.out, {"--cache": args.cache, "--outputs": args.outputs, "--texts": args.texts},
                   suffix="export")
    common = {"texts": args.texts, "field": args.field, "compression_level": args.compression_level,
              "overwrite": args.overwrite}
    with os_errors_name(args.out):
        if args.cache:
            summary = export_cache(args.cache, args.out, args.format, **common)
        else:
            summary = export_outputs(args.outputs, args.out, args.format, **common)
    print(summary)
    return 0
