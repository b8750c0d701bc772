"""`python -m nblib predict`: a `train --records` run's final weights over record shards."""
from __future__ import annotations

import argparse

from nblib.cli.args import finite_positive_float, os_errors_name, parse_or_refuse, positive_int


def predict_main(argv: list[str]) -> int:
    """`python -m nblib predict --run RUN --records DIR --out PRED`: run the model that `train --records --out RUN`
    trained (RUN/final.pt) over record shards that hold its --input-key field (padded and masked as in training),
    and write record shards to PRED, one record per input record in index order: `index`, the model's `output`
    (float32, its padding cut off) and, for a ce run, `prediction`: the class (labels), the top k class indices
    (top-k targets) or the class probabilities (probability targets). Read them with
    nblib.cache.RecordShards(PRED). A killed run resumes when rerun.
    """
    from nblib.errors import ConfigError
    from nblib.train.records import EVAL_BATCH, predict_records

    p = argparse.ArgumentParser(prog="python -m nblib predict", description=predict_main.__doc__,
                                exit_on_error=False)
    p.add_argument("--run", help="the --out folder of a finished train --records run")
    p.add_argument("--records", help="record shards (cache --records) holding the run's --input-key")
    p.add_argument("--out", help="folder for the prediction shards")
    p.add_argument("--batch-size", type=positive_int, default=EVAL_BATCH,
                   help="records per forward (default %(default)s)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when a GPU is present, else cpu)")
    p.add_argument("--shard-size-mb", type=finite_positive_float, default=400, help="the most MB per output shard")
    p.add_argument("--overwrite", action="store_true", help="replace other record shards in --out")
    args = parse_or_refuse(p, argv)
    missing = [f"--{name}" for name in ("run", "records", "out") if getattr(args, name) is None]
    if missing:
        raise ConfigError(f"predict needs {', '.join(missing)}: python -m nblib predict --run RUN --records DIR "
                          f"--out PRED")
    with os_errors_name(args.out):
        summary = predict_records(args.run, args.records, args.out, batch_size=args.batch_size, device=args.device,
                                  shard_mb=args.shard_size_mb, overwrite=args.overwrite)
    print(summary)
    return 0
