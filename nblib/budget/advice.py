"""What to turn when a budget does not fit: for every resource over its limit, the knobs and the values that fit.

`advise(budget)` returns one `Advice` per resource over its limit (VRAM, RAM, local disk, Drive)
and per Drive limit crossed (items per folder, uploads per day). Each names only the knobs that
close the gap, each with the value that fits (the largest batch, the largest checkpoint or
consolidation cadence, the largest output subset, float16, a codec, the Drive size);
a knob whose best value still leaves the resource over is dropped. When no knob closes it alone,
the smallest combination that does is given, else what to buy. `closing_knobs` does the same for
one disk shared by several resources (a refusal's "what to turn"). Values aim at (1 - MARGIN) of
the limit, as `max_batch_size` and `plan_budget` do. Trade-off: each knob is searched alone, then
subsets of knobs at their extreme values (a few dozen closed-form predictions of ~6 ms each, only
when no single knob fits); choosing the best whole config is `plan_budget`'s job.
"""
from __future__ import annotations

import ast
import itertools
import math
from dataclasses import dataclass

from nblib.budget.disk import (
    CODEC_RATIO_ESTIMATE,
    cache_bytes,
    codec_stats,
    fastest_fitting,
    size_source,
    smaller_codecs,
)
from nblib.budget.drive import smallest_checkpoint_every
from nblib.budget.resources import FIT_MARGIN, KNOBS, fits, largest_fitting, room, shortfall_figure
from nblib.config import OUTPUT_CHOICES
from nblib.units import GB

__all__ = [
    "MARGIN", "NAMES", "OPTION_KNOBS", "RUN_KNOBS", "Advice", "Suggestion", "advise", "advise_resource",
    "cache_knobs", "closing_knobs", "knob_words",
]

MARGIN = FIT_MARGIN
RUN_KNOBS = ("batch_size", "checkpoint_every", "consolidate_every", "prefetch", "workers", "outputs",
             "out_dtype", "codec")
OPTION_KNOBS = ("drive_quota_gb",)
NAMES = {"vram": "VRAM", "ram": "RAM", "local disk": "local disk", "drive": "Drive"}
DISK = {"local disk", "drive"}     # the resources whose totals need no VRAM trace (Budget.disk_totals_with)


@dataclass(frozen=True)
class Suggestion:
    """Set `knob` to `value` (never its current value); `effect` says what that gives."""

    knob: str          # "run.batch_size", "run.outputs", "drive_quota_gb", ...
    value: object
    current: object
    effect: str        # "the largest that fits VRAM and RAM", "RAM 9.80 GB", "Drive 43.1 GB, still over"
    also: str = ""     # a second knob the value needs ("run.consolidate_every=40")
    together: bool = False   # no knob closes the gap alone: this one and `also` are the smallest combination

    def __str__(self) -> str:
        if self.together:
            return f"no single knob closes it: {self.knob}={self.value!r} and {self.also} ({self.effect})"
        also = f" with {self.also}" if self.also else ""
        return f"{self.knob}={self.value!r}{also} ({self.effect})"


@dataclass(frozen=True)
class Advice:
    """One resource (or Drive limit) over its limit, and what to turn."""

    resource: str
    text: str          # "RAM 33.29 > 11.00 GB" or a Drive limit check's numbers
    suggestions: tuple[Suggestion, ...]
    fallback: str = ""  # the knobs in words when no value could be computed
    note: str = ""      # why no knob of the run is offered ("no knob of the run closes it: even ...")

    @property
    def turns(self) -> str:
        """What to turn, without the numbers: the suggestions (after the note), else the words."""
        turns = "; or ".join(str(s) for s in self.suggestions)
        if self.note:
            return f"{self.note}; {turns}" if turns else self.note
        return turns or self.fallback

    def __str__(self) -> str:
        return f"{self.text}: {self.turns}" if self.turns else self.text


def advise(budget) -> tuple[Advice, ...]:
    """One Advice per resource over its limit (worst first), then one per Drive limit crossed."""
    advice = [advise_resource(budget, r) for r in budget.over]
    advice += [Advice(c.name, c.numbers, (), c.knob) for c in budget.drive_limits if c.crossed]
    return tuple(advice)


def advise_resource(budget, resource: str, limit: float | None = None) -> Advice:
    """What brings `resource` within `limit` (default: the budget's) less the margin: only knobs that close it."""
    limit = budget.limits[resource] if limit is None else limit
    need = budget.totals[resource]
    search = _Search(budget, (resource,), limit)
    found, note = search.closing(_CANDIDATES[resource], buy=resource == "drive")
    return Advice(resource, f"{NAMES[resource]} {need / GB:.2f} > {room(limit) / GB:.2f} GB "
                            f"({1 - MARGIN:.0%} of {limit / GB:.2f} GB)", found,
                  knob_words(budget.config, resource), note)


def closing_knobs(budget, resources: tuple[str, ...], free: float, *, buy: str = "free disk") -> str:
    """The knobs that bring the sum of `resources` (one disk's) within `free` less the margin, in words.

    Each knob that closes the gap alone, with its value and what it saves; when none does, the
    smallest combination that does ("no single knob closes it: ..."); when nothing the run can
    turn is enough, how much more of `buy` ("free disk": bytes more free on that folder;
    "drive_quota_gb": the Drive size that holds it).
    """
    search = _Search(budget, tuple(resources), free)
    knobs = [k for r in resources for k in _CANDIDATES[r] if k != "drive_quota"]
    found, fallback = search.closing(list(dict.fromkeys(knobs)), buy=False)
    more = (str(search.drive_quota(fallback and search.most_of(list(dict.fromkeys(knobs))))) if buy == "drive_quota_gb"
            else f"{shortfall_figure(search.total(), free)} more {buy} on that folder")
    if found:
        return "; or ".join(map(str, found)) + f"; or {more}"
    return f"{fallback}; or {more}" if fallback else more


def cache_knobs(config, need: float, free: float, *, codec_sizes=None) -> str:
    """What brings an image cache of `need` bytes within `free` less the margin: a codec, fewer samples, more disk.

    The codec is the one codec rule's (`nblib.budget.choose_codec`: the fastest-decoding codec whose cache
    fits), sized by `codec_sizes` (bytes per image per codec measured on the user's texts: a CodecSizes)
    when given, else by the estimated ratios, and the line says which; n_samples the most that fit.
    A knob whose best value still leaves the cache over is not offered.
    """
    r, size = config.run, config.model.image_size
    stats = codec_stats(codec_sizes) if codec_sizes is not None else {}
    if stats:
        sizes = {c: cache_bytes(r.n_samples, size, c, s["bytes_per_image"], shard_mb=r.shard_mb)
                 for c, s in stats.items()}
    else:
        scale = need / max(1, cache_bytes(r.n_samples, size, r.codec, shard_mb=r.shard_mb))   # a measured need
        sizes = {c: cache_bytes(r.n_samples, size, c, shard_mb=r.shard_mb) * scale for c in CODEC_RATIO_ESTIMATE}
    turns = []
    codec = fastest_fitting({c: b for c, b in sizes.items() if b < need}, free,
                            {c: s["decode_images_per_s"] for c, s in stats.items()})
    if codec is not None:
        turns.append(f"run.codec={codec!r} (the cache {sizes[codec] / GB:,.2f} GB, the fastest-decoding codec "
                     f"that fits, {size_source(codec, codec_sizes)})")
    most = largest_fitting(lambda n: fits(need * n / r.n_samples, free), r.n_samples - 1)
    if most:
        turns.append(f"run.n_samples={most:,} (the cache {need * most / r.n_samples / GB:,.2f} GB)")
    turns.append(f"{shortfall_figure(need, free)} more free disk on that folder")
    return "; or ".join(turns)


def knob_words(config, resource: str, *, on_drive: bool = True, codec_sizes=None) -> str:
    """The knobs that lower `resource` for this config, in words (a refusal's "what to turn").

    Never a value already set (no "a float16 run.out_dtype" for a float16 run, no "a compressed
    codec" for a zlib cache), and only the knob of the resource that ran out: a durable copy that
    is not on Google Drive (`on_drive=False`, e.g. the local stand-in sharing the staging disk) is
    helped by free disk, not by a bigger drive_quota_gb. `resource` is one of RESOURCES or "cache"
    (the image cache's own disk). Falls back to KNOBS' fixed words for a resource it does not know.
    The codecs smaller than the run's (by `codec_sizes` when measured, else the estimated ratios) are
    named in the one codec rule's order: the fastest-decoding first, the first that fits is the one.
    """
    r = config.run
    turns: list[str] = []
    if resource == "vram":
        turns += ["lower run.batch_size (see max_batch_size)" if r.batch_size > 1 else "a smaller model"]
        turns += ["lower run.consolidate_every"] if r.consolidate_every > 1 else []
    elif resource == "ram":
        turns += ["lower run.checkpoint_every"] if r.checkpoint_every > 1 else []
        turns += ["lower run.batch_size"] if r.batch_size > 1 else []
        turns += ["fewer run.prefetch/workers"] if r.prefetch > 0 or r.workers > 0 else []
    elif resource == "local disk":          # the run folder keeps every part and the consolidated outputs
        turns += ["keep fewer run.outputs"] if len(r.outputs) > 1 else []
        turns += ["a float16 run.out_dtype"] if r.out_dtype != "float16" else []
        turns += ["free disk on that folder"]
    elif resource in ("drive", "cache"):
        smaller = smaller_codecs(r.codec, codec_sizes)
        measured = codec_sizes is not None and codec_sizes.bytes_per_image
        source = "sizes measured" if measured else "sizes by the estimated ratios, not measured"
        if resource == "drive":
            turns += ["keep fewer run.outputs"] if len(r.outputs) > 1 else []
            turns += ["a float16 run.out_dtype"] if r.out_dtype != "float16" else []
        turns += [f"a compressed run.codec (the first of {', '.join(smaller)} that fits: the fastest-decoding "
                  f"first; {source})"] if smaller else []
        turns += ["fewer run.n_samples"] if resource == "cache" else []
        turns += ["a bigger drive_quota_gb" if on_drive and resource == "drive" else "free disk on that folder"]
    else:
        return KNOBS[resource]
    return ", ".join(turns[:-1]) + (" or " if len(turns) > 1 else "") + turns[-1]


# ------------------------------------------------------------------------------- per resource


# The knobs searched per resource, in the order they are offered (the cheapest to accept first).
_CANDIDATES = {
    "vram": ["batch_size", "consolidate_every"],
    "ram": ["batch_size", "checkpoint_every", "prefetch", "workers"],
    "local disk": ["out_dtype", "outputs"],
    "drive": ["out_dtype", "outputs", "codec", "drive_quota"],
}
_SEARCHED = ("batch_size", "checkpoint_every", "consolidate_every")    # each with its own search (_Search's method)


class _Search:
    """Predictions of some resources (one disk's, or one limit's) with knobs changed, against a limit, less margin."""

    def __init__(self, budget, resources: tuple[str, ...], limit: float):
        self.budget, self.resources, self.limit, self.target = budget, resources, limit, room(limit)
        self.config = budget.config
        self.label = " + ".join(NAMES[r] for r in resources)

    def total(self, resource: str | None = None, **changes) -> int:
        """The predicted total of `resource` (default: the sum of this search's) with `changes` applied."""
        run = {k: v for k, v in changes.items() if k in RUN_KNOBS}
        options = {**self.budget.options, **{k: v for k, v in changes.items() if k in OPTION_KNOBS}}
        if "codec" in run and options.get("codec"):
            options["codec"] = run["codec"]
        if changes and set(self.resources) <= DISK and (resource is None or resource in DISK):
            totals = self.budget.disk_totals_with(run, options)       # no VRAM traced for a line not printed
        else:
            totals = (self.budget.with_changes(run, options) if changes else self.budget).totals
        return totals[resource] if resource else sum(totals[r] for r in self.resources)

    def fits(self, **changes) -> bool:
        return fits(self.total(**changes), self.limit)

    def closing(self, knobs: list[str], *, buy: bool) -> tuple[tuple[Suggestion, ...], str]:
        """(the knobs that close the gap alone, with values; else the smallest combination) and a fallback line."""
        single = [getattr(self, knob)() if knob in _SEARCHED else self._first_fitting(knob)
                  for knob in knobs if knob != "drive_quota"]
        found = [s for s in single if s is not None and s.value != s.current and self.fits(**_changes(s))]
        fallback = ""
        if not found:
            combined, fallback = self.combination([k for k in knobs if k != "drive_quota"])
            found = [combined] if combined is not None else []
        if buy and "drive_quota" in knobs:     # one Drive size: with the run's knobs at their most when none closes it
            found.append(self.drive_quota(fallback and self.most_of([k for k in knobs if k != "drive_quota"])))
        return tuple(found), fallback

    def most_of(self, knobs: list[str]) -> dict:
        """The changes of every knob at its biggest saving together."""
        return _merged(self._most(k, o) for k in knobs if (o := self.options(k)))

    def combination(self, knobs: list[str]) -> tuple[Suggestion | None, str]:
        """The fewest knobs that fit together, each at the least change that still fits; else why not."""
        choices = {k: o for k in knobs if (o := self.options(k))}
        most = {k: self._most(k, o) for k, o in choices.items()}      # each knob's biggest saving
        names = list(choices)
        for size in range(2, len(names) + 1):
            for subset in itertools.combinations(names, size):
                if not self.fits(**_merged(most[k] for k in subset)):
                    continue
                chosen: list = []
                for i, knob in enumerate(subset):
                    rest = [most[k] for k in subset[i + 1:]]
                    chosen.append(next(o for o in choices[knob] if self.fits(**_merged([*chosen, o, *rest]))))
                extra = {f: v for k, o in zip(subset, chosen) for f, v in o[1].items() if f != k}
                also = " and ".join([*(f"{_knob_name(k)}={o[0]!r}" for k, o in zip(subset[1:], chosen[1:])),
                                     *(f"{_knob_name(f)}={v!r}" for f, v in extra.items()
                                       if f not in subset and v != self.current(f))])
                return (Suggestion(_knob_name(subset[0]), chosen[0][0], self.current(subset[0]),
                                   self._effect(**_merged(chosen)), also, together=True),
                        "")
        if not names:
            return None, ""
        every = self.most_of(names)
        words = " and ".join(f"{_knob_name(k)}={most[k][0]!r}" for k in names)
        return None, (f"no knob of the run closes it: even {words} together leave "
                      f"{self.label} {self.total(**every) / GB:,.2f} GB, over {self.target / GB:,.2f} GB"
                      + (f" ({self._size_source(every['codec'])})" if "codec" in every else ""))

    def _most(self, knob: str, options: list) -> tuple[object, dict]:
        """The option of `knob` that saves the most: the last (options run from the least change to the most),
        but for the codec, listed in the one codec rule's order, the smallest cache.
        """
        if knob != "codec":
            return options[-1]
        return min(options, key=lambda o: self.total(**o[1]))

    def options(self, knob: str) -> list[tuple[object, dict]]:
        """(value, changes) of `knob` below its current value, from the least change to the most."""
        r = self.config.run
        if knob == "out_dtype":
            return [("float16", {"out_dtype": "float16"})] if r.out_dtype != "float16" else []
        if knob == "outputs":
            smaller = {o: self.total(outputs=o) for o in OUTPUT_CHOICES if o != r.outputs}
            smaller = {o: t for o, t in smaller.items() if t < self.total()}
            return [(o, {"outputs": o}) for o in sorted(smaller, key=lambda o: -smaller[o])]
        if knob == "codec":
            return [(c, {"codec": c}) for c in self._smaller_codecs()]
        if knob in ("prefetch", "workers"):
            lowest = 1 if knob == "prefetch" else 0
            return [(v, {knob: v}) for v in range(getattr(r, knob) - 1, lowest - 1, -1)][-2:]
        if knob in ("batch_size", "checkpoint_every", "consolidate_every"):
            cap = {"batch_size": r.n_samples, "checkpoint_every": -(-r.n_samples // r.batch_size)}.get(knob, 1 << 62)
            values = sorted({min(cap, max(1, getattr(r, knob) >> i)) for i in range(1, 40)} - {getattr(r, knob)},
                            reverse=True)      # halvings, never above what the run holds
            if knob == "consolidate_every":
                values = [v for v in values if r.checkpoint_every % v == 0]
            if knob == "checkpoint_every":
                return [(v, {"checkpoint_every": v, "consolidate_every": _largest_divisor(v, r.consolidate_every)})
                        for v in values]
            return [(v, {knob: v}) for v in values]
        return []

    def current(self, knob: str):
        if knob in OPTION_KNOBS:
            return self.budget.options.get(knob)
        return getattr(self.config.run, knob)

    def batch_size(self) -> Suggestion | None:
        """The largest batch whose VRAM and RAM both fit: `max_batch_size`, with this search's limit."""
        memory = [r for r in ("vram", "ram") if self.budget.limits[r] > 0]
        best = self.budget.largest_batch({r: self.limit for r in self.resources if r in memory})
        current = self.config.run.batch_size
        best = min(best, current - 1)
        if best < 1:
            return None
        return Suggestion("run.batch_size", best, current,
                          f"the largest that fits {' and '.join(NAMES[r] for r in memory)} with a "
                          f"{MARGIN:.0%} margin")

    def checkpoint_every(self) -> Suggestion | None:
        """The largest checkpoint cadence that fits: a multiple of consolidate_every, else both lowered."""
        r = self.config.run

        def changes(every: int) -> dict:
            return {"checkpoint_every": every, "consolidate_every": _largest_divisor(every, r.consolidate_every)}

        batches = -(-r.n_samples // r.batch_size)     # a part never holds more than the run's batches
        best = largest_fitting(lambda every: self.fits(**changes(every)), min(r.checkpoint_every - 1, batches))
        if not best:
            return None
        if best >= r.consolidate_every:
            best -= best % r.consolidate_every       # keep consolidate_every as it is
        cons = changes(best)["consolidate_every"]
        also = f"run.consolidate_every={cons}" if cons != r.consolidate_every else ""
        effect = self._effect(**changes(best))
        fewest = smallest_checkpoint_every(self.config.replace(consolidate_every=1))
        if fewest is None or best < fewest:
            effect += f", but its {-(-r.n_batches // best):,} parts cross Drive's items-per-folder limit"
        return Suggestion("run.checkpoint_every", best, r.checkpoint_every, effect, also)

    def consolidate_every(self) -> Suggestion | None:
        """The largest divisor of checkpoint_every, below the current cadence, that fits."""
        r = self.config.run
        for cons in sorted((d for d in range(1, r.consolidate_every) if r.checkpoint_every % d == 0), reverse=True):
            if self.fits(consolidate_every=cons):
                return Suggestion("run.consolidate_every", cons, r.consolidate_every,
                                  self._effect(consolidate_every=cons))
        return None

    def drive_quota(self, changes: dict | str = "") -> Suggestion:
        """The Drive that holds the run (with `changes`, the knobs at their most, when no knob of the run closes it)."""
        need = self.total(resource="drive", **(changes or {}))
        value = math.ceil(need / (1 - MARGIN) / GB)
        return Suggestion("drive_quota_gb", value, self.budget.options.get("drive_quota_gb"),
                          f"a Drive of {value:,} GB holds {need / GB:,.1f} GB with a {MARGIN:.0%} margin"
                          + (" and the knobs above" if changes else ""))

    def _first_fitting(self, knob: str) -> Suggestion | None:
        """The first option of `knob` that fits (`options`: from the least change to the most): the largest output
        subset; for the codec, the one codec rule's pick (`choose_codec`: the fastest-decoding smaller codec that
        fits, sized by the measured codec_sizes, else the estimated ratios; none for a measured bytes_per_image).
        """
        for value, changes in self.options(knob):
            if self.fits(**changes):
                return Suggestion(_knob_name(knob), value, self.current(knob), self._effect(**changes))
        return None

    def _smaller_codecs(self) -> list[str]:
        """Codecs smaller than the run's, in the one codec rule's order (`by_decode_speed`: the fastest decoding
        first), sized by the budget's codec_sizes (measured on the user's texts) when given, else the reference's
        ratios.
        """
        opts = self.budget.options
        if opts.get("bytes_per_image") is not None or "drive" not in self.resources:
            return []
        return smaller_codecs(opts.get("codec") or self.config.run.codec, opts.get("codec_sizes"))

    def _size_source(self, codec: str) -> str:
        """'zstd measured on 300 texts' or 'zstd at the estimated ratio 0.09 of raw, not measured'."""
        return size_source(codec, self.budget.options.get("codec_sizes"))

    def _effect(self, **changes) -> str:
        total = self.total(**changes)
        verdict = "" if fits(total, self.limit) else (", still over" if total > self.limit
                                                   else f", within the {MARGIN:.0%} margin")
        saves = self.total() - total
        source = f", {self._size_source(changes['codec'])}" if "codec" in changes else ""
        return (f"{self.label} {total / GB:,.2f} GB" + (f", saves {saves / GB:,.1f} GB" if saves > 0 else "")
                + verdict + source)


def _knob_name(knob: str) -> str:
    return knob if knob in OPTION_KNOBS else f"run.{knob}"


def _merged(options) -> dict:
    """One changes dict from (value, changes) options."""
    merged: dict = {}
    for _value, changes in options:
        merged.update(changes)
    return merged


def _changes(s: Suggestion) -> dict:
    """The changes a Suggestion names (its knob and its `also`), for re-checking that it fits."""
    changes = {s.knob.removeprefix("run."): s.value}
    for part in filter(None, s.also.split(" and ")):
        name, value = part.split("=", 1)
        changes[name.removeprefix("run.")] = ast.literal_eval(value)
    return changes


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
