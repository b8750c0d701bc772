"""`python -m nblib budget`: a config's budget, its plan, the reference table, or a model's traced VRAM."""
from __future__ import annotations

import argparse

from nblib.cli.args import finite_positive_float, parse_or_refuse
from nblib.models.load import spec_forms


def budget_main(argv: list[str]) -> int:
    """`python -m nblib budget`: print a config's budget, its plan, or the reference table."""
    from nblib.budget import DEVICES, max_batch_size, plan_budget, predict_budget
    from nblib.budget.devices import device_preset
    from nblib.config import preset
    from nblib.sdpa import SDPA_BACKENDS

    p = argparse.ArgumentParser(prog="python -m nblib budget", description=budget_main.__doc__, exit_on_error=False)
    p.add_argument("--preset", default="seed_t4")
    p.add_argument("--device", default="t4", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--n-samples", "--samples", type=int, help="samples to encode (a preset), or with --model "
                   "--train: the samples of an epoch, for its projected T4 time")
    p.add_argument("--dtype", choices=("float16", "float32"))
    p.add_argument("--outputs", help="comma-separated subset of sketches,checksums,children")
    p.add_argument("--sdpa", choices=SDPA_BACKENDS)
    p.add_argument("--drive-quota-gb", type=finite_positive_float, default=15.0)
    p.add_argument("--plan", action="store_true", help="recommend knobs that fit")
    p.add_argument("--texts", help="your texts (file or JSONL): the verdict and the plan measure the cache's bytes "
                                   "per image on a few hundred of them (default: the suite's sample texts, "
                                   "data/sample_texts.jsonl, as notebook 01)")
    p.add_argument("--reference", action="store_true", help="reference analysis vs this suite")
    p.add_argument("--model", help=f"budget this model's VRAM from a trace of its own code ({spec_forms()})")
    p.add_argument("--weights", help="a state-dict file for --model")
    p.add_argument("--train", action="store_true", help="with --model: a training step, not encoding")
    p.add_argument("--input", default="images", help="with --model: what the model takes: images (the default) or "
                   "tokens:LENGTH (input_ids and attention_mask, a BERT-style text encoder; with --train, a train "
                   "--records step on records of LENGTH token ids with class labels of the output's rows)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--json", action="store_true", help="with --model: print the budget as JSON (bytes)")
    p.add_argument("--cache", help="with --model --train: the image cache an epoch reads (its training split is the "
                   "epoch's count unless --samples; its input pipeline is measured for the epoch's floor)")
    args = parse_or_refuse(p, argv)
    device_preset(args.device)     # an unknown device is refused before anything is measured
    if args.model:
        return _model_budget(args)
    if args.reference:
        from nblib.budget.reference_check import reference_table

        print(reference_table(args.device))
        return 0
    changes = {k: v for k, v in (("batch_size", args.batch_size), ("n_samples", args.n_samples),
                                 ("out_dtype", args.dtype)) if v is not None}
    if args.outputs:
        changes["outputs"] = tuple(o.strip() for o in args.outputs.split(","))
    cfg = preset(args.preset).replace(**changes)
    kwargs = {"drive_quota_gb": args.drive_quota_gb, "sdpa_backend": args.sdpa}
    from nblib.cache.texts import sample_texts_path
    from nblib.codec_sizes import codec_sizes

    # the verdict and the plan size the cache by one measurement: the user's texts, else notebook 01's sample texts
    sizes = codec_sizes(args.texts or sample_texts_path(), cfg.model.image_size)
    print(sizes if args.texts else f"{sizes}; the suite's sample texts, as notebook 01 (--texts FILE: yours)")
    print(predict_budget(cfg, args.device, codec_sizes=sizes, **kwargs).table())
    print(f"max batch size on {args.device}: {max_batch_size(cfg, args.device, **kwargs):,}")
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

        model = load_model(args.model, args.weights, inputs="images" if args.input == "images" else "tokens")
    if args.train:
        import nblib.train  # noqa: F401  hands the training job over (only here: it sets CUBLAS_WORKSPACE_CONFIG)
    budget = model_vram(model, args.batch_size or 64, args.device, precision=args.precision, train=args.train,
                        inputs=args.input)
    print(json.dumps(budget.as_json(), indent=1) if args.json else budget.table())
    if args.train and not args.json:
        print(t4_epoch_line(args))
    budget.refuse_if_over()
    return 0


def t4_epoch_line(args: argparse.Namespace) -> str:
    """`budget --model M --train`: the projected T4 time of an epoch (nblib.t4_speed.model_projection), and beside
    it the floor the input pipeline sets (measured here over --cache, or the command that measures it).
    """
    from nblib.errors import ConfigError
    from nblib.models import load_model
    from nblib.models.head import _image_size
    from nblib.t4_speed import model_projection

    if args.input != "images":
        return f"T4 time per epoch: not projected for --input {args.input} (nblib.t4_speed projects image models)"
    if args.device != "t4":
        return f"time per epoch: projected for a T4 only (--device t4); {args.device} has no sourced speed"
    n, whose, cache = args.n_samples, "", None
    if n is None and args.cache is None:
        return ("T4 time per epoch: needs the sample count: --samples N (or --cache CACHE: its training split) "
                "(projection: nblib.t4_speed)")
    if args.cache is not None:
        from nblib.cache import ShardedImageCache
        from nblib.train.config import TrainConfig
        from nblib.train.data import split

        cache = ShardedImageCache(args.cache)
        if n is None:
            n = len(split(len(cache), TrainConfig.holdout)[0])
            whose = f" (the cache's {len(cache):,} less train's {TrainConfig.holdout:.0%} held out)"
    loaded = load_model(args.model, args.weights)
    try:
        p = model_projection(loaded, _image_size(loaded), args.precision, train=True, n_samples=n)
    except ConfigError as exc:
        return f"T4 time per epoch: not projected: {exc}"
    return (f"T4 time per epoch ({p.label}, nblib.t4_speed: public T4 measurements with their sources): {n:,} "
            f"samples{whose} in {p.hours_text()} at {p.rate_text()}, {p.precision} training, if FLOPs bound it; "
            f"{pipeline_floor(cache, n, args.batch_size or 64)}")


def pipeline_floor(cache, n: int, batch_size: int) -> str:
    """The epoch's floor the input pipeline sets: `cache` read as `python -m nblib pipeline` reads it (a
    DataLoader of contiguous batches, no workers, no consumer), measured on this machine; without a cache, the
    command that measures it.
    """
    if cache is None:
        return ("input pipeline not measured: run python -m nblib pipeline --cache CACHE --rss-cap-gb 11 to "
                "measure it (an epoch takes at least the longer of the two)")
    from nblib.pipeline import measure_pipeline
    from nblib.pipeline.torch_loaders import cache_loader, repeated
    from nblib.units import fmt_duration, fmt_rate

    report = measure_pipeline(lambda: repeated(cache_loader(cache, min(batch_size, len(cache)))), steps=10)
    return (f"input pipeline floor {fmt_duration(n / report.samples_per_s)} ({fmt_rate(report.samples_per_s)} "
            f"reading the cache, measured here: DataLoader, 0 workers, batch {report.batch_size}; a Colab T4 "
            f"host has 2 cores): an epoch takes at least the longer of the two")
