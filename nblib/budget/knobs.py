"""Pick the knobs that make a job fit a device: batch size, output dtype and subset, cadences, codec.

`plan_budget(config, device)` keeps as much output as it can: the config's own outputs and dtype
first, then fp16, then fewer outputs (`nblib.config.OUTPUT_CHOICES`), each with the fastest-decoding
codec whose cache fits (the one codec rule, `nblib.budget.disk.choose_codec`'s); for each, the
largest checkpoint cadence whose RAM fits and the largest consolidation cadence whose
VRAM fits, never so small that the parts cross Drive's items-per-folder limit. It returns a
`BudgetPlan` that says what changed, or why nothing fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib.budget._checks import validated
from nblib.budget.devices import Device, device_preset
from nblib.budget.disk import CODEC_RATIO_ESTIMATE, NO_CACHE, by_decode_speed, codec_stats, size_source
from nblib.budget.drive import smallest_checkpoint_every
from nblib.budget.predict import Budget, max_batch_size, predict_budget
from nblib.budget.resources import FIT_MARGIN, RESOURCES, fits
from nblib.config import CODECS, OUTPUT_CHOICES, PipelineConfig
from nblib.units import fmt_bytes

__all__ = [
    "BudgetPlan", "plan_budget",
]

@dataclass(frozen=True)
class BudgetPlan:
    """A recommended config for a device, the budget it gets, and why."""

    config: PipelineConfig
    budget: Budget
    changes: dict
    fits: bool
    reason: str

    def __str__(self) -> str:
        if not self.fits:
            return f"NOTHING FITS: {self.reason}"
        changed = ", ".join(f"{k}={v!r}" for k, v in self.changes.items()) or "the config as is"
        return f"FITS with {changed}: {self.reason}"


def plan_budget(config: PipelineConfig, device: str | Device = "t4", *, margin: float = FIT_MARGIN,
                cacheless: bool = False, codec_sizes=None, **predict_kwargs) -> BudgetPlan:
    """Pick batch_size, out_dtype, outputs, checkpoint_every and consolidate_every that fit.

    Preference: the config's own outputs and dtype first, then fp16, then fewer outputs; for each,
    the largest checkpoint_every (fewest parts) whose RAM fits and the largest consolidate_every
    dividing it whose VRAM fits. `cacheless=True` also tries, after every cached choice, no image
    cache at all (images rendered on the fly, `NO_CACHE`): changes then holds cache="none".
    Every codec of the cache's registry is tried (`nblib.config.CODECS`) for each of those, in the one
    codec rule's order (`nblib.budget.disk.by_decode_speed`, as `choose_codec`): the codec is the
    fastest-decoding one whose cache fits beside the most output that fits.

    Args:
        config: the pipeline config to start from.
        device: a preset name of `nblib.budget.DEVICES` or a `Device`.
        margin: the share of each limit kept free (0.1: aim at 90%).
        cacheless: also try rendering on the fly instead of an image cache.
        codec_sizes: an `nblib.codec_sizes.CodecSizes` (bytes per image per codec, measured on the
            user's texts); None uses the reference's ratios, and the reason says so.
        **predict_kwargs: passed to `predict_budget` (codec, drive_quota_gb, ...).

    Returns:
        A `BudgetPlan`: the config that fits, its Budget, what changed, or why nothing fits.
    """
    cfg, dev = validated(config), device_preset(device)
    r = cfg.run
    batch = min(r.batch_size, max_batch_size(cfg.replace(consolidate_every=1, checkpoint_every=1),
                                             dev, margin, **predict_kwargs))
    if batch == 0:
        b1 = predict_budget(cfg.replace(batch_size=1, consolidate_every=1, checkpoint_every=1),
                            dev, **predict_kwargs)
        return BudgetPlan(cfg, b1, {}, False, f"even batch_size=1 does not fit: {b1.verdict}")
    dtypes = [r.out_dtype] + [d for d in ("float16",) if d != r.out_dtype]
    outputs = [r.outputs] + [o for o in OUTPUT_CHOICES if o != r.outputs]
    stats = codec_stats(codec_sizes) if codec_sizes is not None else {}
    codecs = [predict_kwargs["codec"] or r.codec] if "codec" in predict_kwargs else \
        by_decode_speed(stats or [c for c in CODECS if c in CODEC_RATIO_ESTIMATE],
                        {c: s["decode_images_per_s"] for c, s in stats.items()})      # the one codec rule's order
    choices = [(c, o, d) for o in outputs for d in dtypes for c in codecs]
    if cacheless and "codec" not in predict_kwargs:
        choices += [(NO_CACHE, o, d) for o in outputs for d in dtypes]
    tried = []
    for codec, outs, dtype in choices:
        kwargs = {**predict_kwargs, "codec": NO_CACHE} if codec == NO_CACHE else predict_kwargs
        if codec in stats and "bytes_per_image" not in predict_kwargs:
            kwargs = {**kwargs, "bytes_per_image": stats[codec]["bytes_per_image"]}
        trial = cfg.replace(batch_size=batch, outputs=outs, out_dtype=dtype,
                            codec=r.codec if codec == NO_CACHE else codec)
        found = _cadence_that_fits(trial, dev, margin, kwargs)
        if found is not None:
            changes = {k: v for k, v in _knobs(found.config).items() if v != _knobs(cfg)[k]}
            if codec == NO_CACHE:
                changes["cache"] = NO_CACHE
            kept = f" (margin {margin:.0%} kept)" if margin != FIT_MARGIN else ""
            return BudgetPlan(found.config, found, changes, True,
                              f"{found.verdict}{kept}; cache: {size_source(codec, codec_sizes)}")
        every = smallest_checkpoint_every(trial.replace(consolidate_every=1)) or 1   # fewest parts Drive takes
        tried.append((codec, predict_budget(trial.replace(checkpoint_every=every, consolidate_every=1), dev,
                                            **kwargs)))
    codec, least = min(tried, key=lambda t: (t[1].totals["drive"], max(t[1].usage.values())))
    biggest = max(least.lines[least.binding], key=lambda line: line.bytes)
    why = (f"even the smallest choice (outputs={least.config.run.outputs}, {least.config.run.out_dtype}, "
           f"{'no' if codec == NO_CACHE else codec} cache, batch {batch}, cadence {least.config.run.checkpoint_every}) "
           f"leaves {least.binding} at {least.usage[least.binding]:,.1%} of its limit; its largest line, "
           f"{biggest.name}, is {fmt_bytes(biggest.bytes)} alone. {least.verdict}; "
           f"cache: {size_source(codec, codec_sizes)}")
    return BudgetPlan(least.config, least, {}, False, why)


def _cadence_that_fits(cfg: PipelineConfig, dev: Device, margin: float, kwargs) -> Budget | None:
    """The budget with the largest checkpoint_every (then consolidate_every) that fits."""
    n_batches = cfg.run.n_batches
    fewest = smallest_checkpoint_every(cfg.replace(consolidate_every=1)) or n_batches
    for every in _descending_choices(min(max(cfg.run.checkpoint_every, fewest), n_batches)):
        if every < fewest:
            return None      # more parts than one Drive folder takes
        for cons in _descending_choices(min(cfg.run.consolidate_every, every)):
            if every % cons:
                continue
            b = predict_budget(cfg.replace(checkpoint_every=every, consolidate_every=cons), dev,
                               **kwargs)
            if all(fits(b.totals[r], b.limits[r], margin) for r in RESOURCES if b.limits[r] > 0):
                return b
            if not fits(b.totals["drive"], b.limits["drive"], margin):
                return None          # Drive does not depend on the cadence: give up early
    return None


def _descending_choices(top: int) -> list[int]:
    """top, then round numbers below it: 200, 100, 50, 20, 10, 5, 2, 1."""
    nice = [n for n in (1000, 500, 200, 100, 50, 20, 10, 5, 2, 1) if n < top]
    return [top] + nice


def _knobs(cfg: PipelineConfig) -> dict:
    knobs = ("codec", "batch_size", "out_dtype", "outputs", "checkpoint_every", "consolidate_every")
    return {k: getattr(cfg.run, k) for k in knobs}
