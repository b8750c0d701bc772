"""`python -m nblib pipeline`: sweep an input pipeline's knobs, recommend under a RAM cap."""
from __future__ import annotations

import argparse

from nblib.cli.args import bounded_float, finite_positive_float, parse_or_refuse, positive_int
from nblib.units import GB


def pipeline_main(argv: list[str]) -> int:
    """`python -m nblib pipeline`: sweep DataLoader knobs over a cache; print the table and the pick under a RAM cap."""
    from nblib.cache import ShardedImageCache
    from nblib.pipeline import recommend
    from nblib.pipeline.grids import TORCH_GRID, device_step, torch_sweep

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
