"""`python -m nblib predict`: a run's final weights over an image cache (`train --cache`) or record shards."""
from __future__ import annotations

import argparse
from pathlib import Path

from nblib.cli.args import finite_positive_float, parse_or_refuse, positive_int
from nblib.errors import ConfigError, os_errors_name

USAGE = "python -m nblib predict --run RUN --cache TEST_CACHE --out DIR (or --records DIR for a train --records run)"


def predict_main(argv: list[str]) -> int:
    """`python -m nblib predict --run RUN --cache TEST_CACHE --out DIR`: score a `train --cache` run (RUN/final.pt)
    on an image cache: DIR/predictions.csv, one row per image (index, key, label, prediction, score, the top k),
    and, when the cache has labels, the accuracy, each class's and the confusion matrix printed, and
    DIR/confusion.png (nblib.train.evaluate.predict_images, then nblib.plots.confusion_matrix).

    `python -m nblib predict --run RUN --records DIR --out PRED`: run the model that `train --records` trained
    over record shards that hold its --input-key field (padded and masked as in training), and write record
    shards to PRED, one record per input record in index order: `index`, the model's `output` (float32, its
    padding cut off) and, for a ce run, `prediction`: the class (labels), the top k class indices (top-k
    targets) or the class probabilities (probability targets). Read them with nblib.cache.RecordShards(PRED).
    A killed run resumes when rerun.

    --out may not be, hold or sit inside --run, --cache or --records: predict never writes into what it reads.
    """
    from nblib.train.evaluate import EVAL_BATCH, TOP_K, check_predict

    p = argparse.ArgumentParser(prog="python -m nblib predict", description=predict_main.__doc__,
                                exit_on_error=False)
    p.add_argument("--run", help="the --out folder of a finished train run")
    p.add_argument("--cache", help="an image cache to score a train --cache run on (cache --images DIR: class "
                                   "subfolders give the labels)")
    p.add_argument("--records", help="record shards (cache --records) holding a train --records run's --input-key")
    p.add_argument("--out", help="folder for the predictions (beside the run and the data, not inside them)")
    p.add_argument("--top-k", type=positive_int, default=TOP_K,
                   help="with --cache: the classes each row lists, most likely first (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=EVAL_BATCH,
                   help="images or records per forward (default %(default)s)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when a GPU is present, else cpu)")
    p.add_argument("--shard-size-mb", type=finite_positive_float, default=400,
                   help="with --records: the most MB per output shard")
    p.add_argument("--overwrite", action="store_true",
                   help="with --records: replace other record shards in --out (never an input: refused)")
    args = parse_or_refuse(p, argv)
    missing = [f"--{name}" for name in ("run", "out") if getattr(args, name) is None]
    if missing or (args.cache is None) == (args.records is None):
        raise ConfigError(f"predict needs {', '.join(missing) or 'one of --cache and --records'}: {USAGE}")
    flag, data = ("--cache", args.cache) if args.cache is not None else ("--records", args.records)
    check_predict(args.run, args.out, flag, data)            # before torch is imported
    with os_errors_name(args.out):
        if flag == "--cache":
            from nblib.train.evaluate import predict_images

            summary = predict_images(args.run, args.cache, args.out, top_k=args.top_k, batch_size=args.batch_size,
                                     device=args.device)
        else:
            from nblib.train.records import predict_records

            summary = predict_records(args.run, args.records, args.out, batch_size=args.batch_size,
                                      device=args.device, shard_mb=args.shard_size_mb, overwrite=args.overwrite)
    print(summary)
    if flag == "--cache" and summary.truth is not None:
        from nblib import plots
        from nblib.train.evaluate import CONFUSION

        plots.close(plots.confusion_matrix(summary.confusion(), summary.classes, title=summary.title,
                                           save_to=Path(args.out) / CONFUSION))
        print(f"confusion matrix: {Path(args.out) / CONFUSION}")
    return 0
