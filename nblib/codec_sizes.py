"""Bytes per cached image for each codec: measured on a sample of the user's own texts, or borrowed.

A cache-size prediction is only as good as its bytes per image. Rendered text compresses by a
factor that depends on the texts (their length, script, how much ink a page holds), so the ratio
of someone else's data misleads: the reference analysis' PNG ratio (0.14 of raw) gives ~40 GB for
1,907,747 images at 224 px where this suite's sample texts give ~10 GB. `codec_sizes(texts, 224)`
renders and compresses a few hundred of the given texts (seconds) with every codec of the
cache's registry (`nblib.config.CODECS`, so a new codec appears here by itself), and falls back
to the reference's ratios (`nblib.budget.disk.CODEC_RATIO_ESTIMATE`) only when no texts are
given. `source` says which was used; every figure printed from it should repeat that
(`nblib.budget.disk.size_source`). Decode speeds travel with the sizes: measured with them, else the
reference's (`CODEC_DECODE_ESTIMATE`), because the codec is chosen by them (`nblib.budget.choose_codec`:
the fastest-decoding codec whose cache fits).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from nblib.budget.disk import (
    CODEC_DECODE_ESTIMATE,
    CODEC_RATIO_ESTIMATE,
    by_decode_speed,
    codec_stats,
    estimated_bytes_per_image,
    stored_bytes_per_image,
)
from nblib.config import CODECS

SAMPLE_TEXTS = 300     # texts rendered and compressed per measurement: a few seconds at 224 px


@dataclass(frozen=True)
class CodecSizes:
    """Bytes one image takes in a shard, per codec, at `image_size`, and where the figures come from."""

    bytes_per_image: dict[str, float]
    image_size: int
    source: str              # "measured on 300 texts of sample_texts.txt" | "the reference analysis' ratio ..."
    measured: bool
    decode_images_per_s: dict[str, float] | None = None   # one core; None: the reference's CODEC_DECODE_ESTIMATE
    n_texts: int = 0                                       # texts measured (0: borrowed)

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """{codec: {"bytes_per_image", "decode_images_per_s"}}: what `nblib.budget.choose_codec` takes."""
        return codec_stats(self)

    def cache_plans(self, n_images: int, cache_dir, shard_mb: float = 400) -> dict:
        """{codec: `nblib.cache.plan_cache`} of a cache of `n_images` at these sizes: bytes, shards, free disk."""
        from nblib.cache import plan_cache

        return {c: plan_cache(n_images, cache_dir, self.image_size, shard_mb, c, b - stored_bytes_per_image(c, 0))
                for c, b in self.bytes_per_image.items()}      # plan_cache adds the checksum and index back

    def __str__(self) -> str:
        raw = self.image_size ** 2 * 3
        sizes = ", ".join(f"{c} {b:,.0f} B ({b / raw:.3f} of raw)" for c, b in self.bytes_per_image.items())
        rates = "measured on one core" if self.measured and self.decode_images_per_s else \
            "the reference's (CODEC_DECODE_ESTIMATE), not measured"
        order = ", ".join(by_decode_speed(self.bytes_per_image, self.decode_images_per_s))
        return (f"bytes per {self.image_size} px image: {sizes}; {self.source}; "
                f"fastest decoding first: {order} ({rates})")


def codec_sizes(texts=None, image_size: int = 224, n: int = SAMPLE_TEXTS) -> CodecSizes:
    """Measured on `texts` when given (their first `n`), else the reference's ratios."""
    if texts is None:
        return reference_codec_sizes(image_size)
    return measure_codec_sizes(texts, image_size, n)


def measure_codec_sizes(texts, image_size: int = 224, n: int = SAMPLE_TEXTS,
                        codecs: tuple[str, ...] = CODECS) -> CodecSizes:
    """Render the first `n` texts at `image_size`, encode each with every codec; mean stored bytes."""
    from nblib.cache import measure_codecs
    from nblib.cache.texts import text_source
    from nblib.render import render_params, render_with

    params = render_params(image_size)
    sample = [render_with(text, params) for text in itertools.islice(text_source(texts), n)]
    stats = measure_codecs(sample, codecs, min_seconds=0.0)
    sizes = {c: stored_bytes_per_image(c, s["bytes_per_image"]) for c, s in stats.items()}
    rates = {c: s["decode_images_per_s"] for c, s in stats.items()}
    name = Path(texts).name if isinstance(texts, (str, Path)) else "the texts given"   # 'sample_texts.txt'
    return CodecSizes(sizes, image_size, f"measured on {len(sample):,} texts of {name}", True, rates, len(sample))


def reference_codec_sizes(image_size: int = 224) -> CodecSizes:
    """The reference analysis' ratios of raw (no texts given): the fallback, labelled as borrowed."""
    sizes = {c: estimated_bytes_per_image(image_size, c) for c in CODECS if c in CODEC_RATIO_ESTIMATE}
    return CodecSizes(sizes, image_size, "no texts given: the reference analysis' ratios of raw "
                      "(nblib/budget/disk.py CODEC_RATIO_ESTIMATE), not measured on your data", False,
                      {c: float(CODEC_DECODE_ESTIMATE[c]) for c in sizes})
