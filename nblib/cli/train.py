"""`python -m nblib train`: training that resumes exactly."""
from __future__ import annotations

import argparse

from nblib.cli.args import finite_positive_float, parse_or_refuse, positive_int, seed_int
from nblib.errors import os_errors_name
from nblib.models.load import spec_forms


def train_main(argv: list[str]) -> int:
    """`python -m nblib train`: train a model on a cache's labels or on record shards; rerunning it resumes."""
    from nblib.train.command import check_train_args, run_train

    args = _train_args(argv)
    checked = check_train_args(args)       # a refusal answers before torch is imported
    from nblib.encode.distributed import join
    from nblib.train.determinism import allowed

    world = join(device=args.device)
    try:
        with os_errors_name(args.out), allowed(args.nondeterministic):
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
    from nblib.env import profile
    from nblib.errors import ConfigError
    from nblib.train.config import LABELS, METRICS, PRECISIONS
    from nblib.train.device import require_device

    p = argparse.ArgumentParser(prog="python -m nblib train", description=train_main.__doc__, exit_on_error=False)
    p.add_argument("--cache", help="folder of a ShardedImageCache with labels (a .jsonl's texts, or a side table)")
    p.add_argument("--val", help="with --cache: an image cache of your own labelled held-out images (classes named as "
                                 "the training cache's), evaluated instead of a split carved from --cache, whose "
                                 "images then all train; the closing line's predict command scores it")
    p.add_argument("--records", help="instead of --cache: record shards (cache --records); needs --input-key and "
                                     "--target-key")
    p.add_argument("--input-key", help="with --records: the array field the model takes")
    p.add_argument("--target-key", help="with --records: the field the loss compares the output with")
    p.add_argument("--loss", choices=("auto", "ce", "mse"), default="auto",
                   help="with --records: ce takes integer class labels (output [..., C]), integer top-k class "
                        "indices [T, k] (output [T, C], C >= k: k-hot multi-label binary cross-entropy) or float "
                        "probability rows [T, C] (soft targets: soft cross-entropy); mse takes float targets of the "
                        "output's shape; auto (default): ce for integer targets, mse for float ones. Padding never "
                        "counts; a --model whose forward takes attention_mask gets it")
    p.add_argument("--classes", type=positive_int, help="with --records, integer targets and no --model: the classes "
                                                         "(for top-k indices: the experts)")
    p.add_argument("--model", help=f"{spec_forms()} (default for --cache: trm; with --records: a per-token "
                                   "linear map)")
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
    p.add_argument("--profile", help="encoder shape: smoke | t4 | full or a preset (default: the profile every verb "
                                     "uses, nblib.env.profile: NBLIB_PROFILE, else t4 with CUDA, smoke without)")
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
    p.add_argument("--nondeterministic", action="store_true",
                   help="let ops torch has no deterministic CUDA kernel for run (warn-only); this run and its resume "
                        "will NOT be bit-identical (default: such a model is refused before its first step)")
    p.add_argument("--no-progress", action="store_true")
    args = parse_or_refuse(p, argv)
    data = "records" if args.records is not None else "cache"
    needs = ("out", "steps", "input_key", "target_key") if data == "records" else ("cache", "out", "steps")
    missing = [f"--{name.replace('_', '-')}" for name in needs if getattr(args, name) is None]
    if missing or (args.cache is not None and args.records is not None):
        raise ConfigError(f"train needs {', '.join(missing) or 'one of --cache and --records'}: python -m nblib "
                          f"train --cache CACHE (or --records DIR --input-key X --target-key Y) --out RUN --steps N "
                          f"[--model SPEC] [--batch-size B] [--seed S] [--mirror DIR_OR_URL]")
    args.profile = args.profile or profile()     # the one default rule, as encode and cache
    args.device = require_device(args.device)    # before any rank joins: one error line, not a CUDA traceback
    return args
