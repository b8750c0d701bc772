"""Input-pipeline throughput: the default vs the recommended config, mixing, render on the fly, streaming RSS.

    python benchmarks/pipeline_sweep.py                    # smoke (512 x 64 px) + t4-sized (20,000 x 224 px) caches
    python benchmarks/pipeline_sweep.py --sizes smoke --steps 20

Prints, measured figures and ratios side by side:
1. tf.data and torch DataLoader sweeps (nblib.lab.input_pipeline grids, --sweep-repeats interleaved passes,
   median kept): the default config and the one `recommend` picks under --rss-cap-gb, with samples/s,
   data-wait and peak RSS, and the speed-up;
2. mixing 4 sources: one dataset, `sample_from_datasets` (budget split by 4), and the fix (interleave the
   records, decode with the whole budget), interleaved --repeats times; the fix must recover >= 80%;
3. render on the fly vs the cache reader (DataLoader, all cores), the render rate per core at 224 px, and the
   encoder's projected rate;
4. peak RSS streaming the cache shard by shard vs loading it all, per cache size (fresh processes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nblib import budget, cache, config
from nblib.lab import input_pipeline as lab
from nblib.pipeline import knob_text, recommend
from nblib.units import GB, fmt_bytes

SIZES = {"smoke": (512, 64, 1), "t4": (20_000, 224, 400)}   # images, pixels, shard MB


def side_by_side(name: str, table, rss_cap: float) -> str:
    """The base and recommended rows of a sweep, column by column, and the speed-up."""
    pick = recommend(table, rss_cap)
    base, best = pick.base, pick.row
    lines = [f"{name}: default vs recommended (cap {fmt_bytes(rss_cap)})",
             f"  {'':<12} {'default':>16} {'recommended':>16}",
             *(f"  {k:<12} {knob_text(base[k]):>16} {knob_text(best[k]):>16}" for k in table.knobs
               if base[k] != best[k]),
             f"  {'samples/s':<12} {base['samples_per_s']:>16,.1f} {best['samples_per_s']:>16,.1f}",
             f"  {'data-wait':<12} {base['data_wait']:>16.0%} {best['data_wait']:>16.0%}",
             f"  {'peak RSS':<12} {fmt_bytes(base['peak_rss_bytes']):>16} {fmt_bytes(best['peak_rss_bytes']):>16}",
             f"  {pick.reason.split('; ')[-1]}"]
    return "\n".join(lines)


def build_cache(folder: Path, size: str):
    n, pixels, shard_mb = SIZES[size]
    texts = cache.sample_texts(n)
    cache.populate(texts, folder / f"{size}_{pixels}px", pixels, shard_mb, progress=False)
    return cache.ShardedImageCache(folder / f"{size}_{pixels}px"), texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="smoke,t4", help="cache sizes for the streaming RSS table (smoke,t4)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs of the mixing experiment")
    p.add_argument("--sweep-repeats", type=int, default=3, help="interleaved passes of each sweep (median kept)")
    p.add_argument("--rss-cap-gb", type=float, default=4.0)
    p.add_argument("--per-sample-ms", type=float, default=0.25, help="stand-in device step per image")
    p.add_argument("--folder", default="outputs/benchmarks/pipeline", help="where the caches are built")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    step, cap = lab.device_step(args.per_sample_ms), args.rss_cap_gb * GB
    images, texts = build_cache(folder, "smoke")
    sources = lab.tf_sources(images, len(images))
    print(f"{lab.cores()} cores; {images!r}; stand-in step {args.per_sample_ms} ms/image\n", flush=True)

    tf_table = lab.tf_sweep(sources, lab.TF_GRID, consumer=step, steps=args.steps, repeats=args.sweep_repeats)
    print(tf_table, "\n" + side_by_side("tf.data", tf_table, cap) + "\n", flush=True)
    torch_table = lab.torch_sweep(images, lab.TORCH_GRID, consumer=step, steps=args.steps,
                                  repeats=args.sweep_repeats)
    print(torch_table, "\n" + side_by_side("torch DataLoader", torch_table, cap) + "\n", flush=True)

    mixing = lab.mixing_experiment(sources, repeats=args.repeats, steps=args.steps)
    print(mixing.table() + "\n", flush=True)

    rates = lab.render_vs_cache(images, texts, steps=args.steps)
    print(lab.rates_table(rates))
    rendered = lab.render_loader_rate(texts, image_size=224)
    encoder, method = lab.encoder_projection(budget.predict_budget(config.preset("seed_t4"), "t4"))
    print(lab.cacheless_verdict(rendered, encoder, method, 224) + "\n", flush=True)

    streaming = {}
    for size in args.sizes.split(","):
        cached, _ = (images, texts) if size == "smoke" else build_cache(folder, size)
        streaming[size] = lab.streaming_vs_load_all(cached.cache_dir)
    print(lab.streaming_table(streaming))
    return 0 if mixing.fix_works else 1


if __name__ == "__main__":
    sys.exit(main())
