"""What to turn when a budget does not fit: for every resource over its limit, the knobs and the values that fit.

`advise(budget)` returns one `Advice` per resource over its limit (VRAM, RAM, local disk, Drive)
and per Drive limit crossed (items per folder, uploads per day). Each names only the knobs that
close the gap, each with the value that fits (the largest batch, the largest checkpoint or
consolidation cadence, keep_local, the largest output subset, float16, a codec, the Drive size);
a knob whose best value still leaves the resource over is dropped. When no knob closes it alone,
the smallest combination that does is given, else what to buy. `closing_knobs` does the same for
one disk shared by several resources (a refusal's "what to turn"). Values aim at (1 - MARGIN) of
the limit, as `max_batch_size` and `plan_budget` do. Trade-off: each knob is searched alone, then
subsets of knobs at their extreme values (a few dozen closed-form predictions of ~6 ms each, only
when no single knob fits); choosing the best whole config is `plan_budget`'s job.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from nblib.budget.disk import CODEC_RATIO_ESTIMATE, cache_bytes
from nblib.budget.drive import smallest_checkpoint_every
from nblib.budget.resources import FIT_MARGIN, KNOBS
from nblib.config import OUTPUT_CHOICES
from nblib.units import GB

__all__ = [
    "MARGIN", "NAMES", "OPTION_KNOBS", "RUN_KNOBS", "Advice", "Suggestion", "advise", "advise_resource",
    "cache_knobs", "closing_knobs", "knob_words",
]

MARGIN = FIT_MARGIN
RUN_KNOBS = ("batch_size", "checkpoint_every", "consolidate_every", "prefetch", "workers", "outputs",
             "out_dtype", "codec")
OPTION_KNOBS = ("keep_local", "drive_quota_gb")
NAMES = {"vram": "VRAM", "ram": "RAM", "local disk": "local disk", "drive": "Drive"}


@dataclass(frozen=True)
class Suggestion:
    """Set `knob` to `value` (never its current value); `effect` says what that gives."""

    knob: str          # "run.batch_size", "keep_local", "drive_quota_gb", ...
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
    over = sorted((r for r, u in budget.usage.items() if u > 1), key=lambda r: -budget.usage[r])
    advice = [advise_resource(budget, r) for r in over]
    advice += [Advice(c.name, c.numbers, (), c.knob) for c in budget.drive_limits if c.crossed]
    return tuple(advice)


def advise_resource(budget, resource: str, limit: float | None = None) -> Advice:
    """What brings `resource` below `limit` (default: the budget's): only knobs that close the gap, with values."""
    limit = budget.limits[resource] if limit is None else limit
    need = budget.totals[resource]
    search = _Search(budget, (resource,), limit * (1 - MARGIN))
    found, note = search.closing(_CANDIDATES[resource], buy=resource == "drive")
    return Advice(resource, f"{NAMES[resource]} {need / GB:.2f} > {limit / GB:.2f} GB", found,
                  knob_words(budget.config, resource), note)


def closing_knobs(budget, resources: tuple[str, ...], free: float, *, buy: str = "free disk") -> str:
    """The knobs that bring the sum of `resources` (one disk's) within `free` less the margin, in words.

    Each knob that closes the gap alone, with its value and what it saves; when none does, the
    smallest combination that does ("no single knob closes it: ..."); when nothing the run can
    turn is enough, how much more of `buy` ("free disk": bytes more free on that folder;
    "drive_quota_gb": the Drive size that holds it).
    """
    search = _Search(budget, tuple(resources), free * (1 - MARGIN))
    knobs = [k for r in resources for k in _CANDIDATES[r] if k != "drive_quota"]
    found, fallback = search.closing(list(dict.fromkeys(knobs)), buy=False)
    need = search.total()
    if buy == "drive_quota_gb":
        more = f"a Drive of {math.ceil(need / (1 - MARGIN) / GB):,} GB (drive_quota_gb)"
    else:
        more = f"{(need / (1 - MARGIN) - free) / GB:,.1f} GB more {buy} on that folder"
    if found:
        return "; or ".join(map(str, found)) + f"; or {more}"
    return f"{fallback}; or {more}" if fallback else more


def cache_knobs(config, need: float, free: float, *, sizes: dict[str, float] | None = None) -> str:
    """What brings an image cache of `need` bytes within `free` less the margin: a codec, fewer samples, more disk.

    The codec is the least compressed one that fits: by `sizes` (codec -> the whole cache's bytes,
    measured on the user's images) when given, else by the estimated ratios; n_samples the most
    that fit. A knob whose best value still leaves the cache over is not offered.
    """
    r, size = config.run, config.model.image_size
    target = free * (1 - MARGIN)
    scale = need / max(1, cache_bytes(r.n_samples, size, r.codec, shard_mb=r.shard_mb))   # a measured need
    if sizes is None:
        sizes = {c: cache_bytes(r.n_samples, size, c, shard_mb=r.shard_mb) * scale for c in CODEC_RATIO_ESTIMATE}
        source = "estimated ratio"
    else:
        source = "measured"
    turns = []
    for codec in sorted((c for c in sizes if sizes[c] < need), key=lambda c: -sizes[c]):
        if sizes[codec] <= target:
            turns.append(f"run.codec={codec!r} (the cache {sizes[codec] / GB:,.2f} GB, {source})")
            break
    most = _largest(1, r.n_samples - 1, lambda n: need * n / r.n_samples <= target)
    if most is not None:
        turns.append(f"run.n_samples={most:,} (the cache {need * most / r.n_samples / GB:,.2f} GB)")
    turns.append(f"{(need / (1 - MARGIN) - free) / GB:,.1f} GB more free disk on that folder")
    return "; or ".join(turns)


def knob_words(config, resource: str, *, on_drive: bool = True) -> str:
    """The knobs that lower `resource` for this config, in words (a refusal's "what to turn").

    Never a value already set (no "a float16 run.out_dtype" for a float16 run, no "a compressed
    codec" for a zlib cache), and only the knob of the resource that ran out: a durable copy that
    is not on Google Drive (`on_drive=False`, e.g. the local stand-in sharing the staging disk) is
    helped by free disk, not by a bigger drive_quota_gb. `resource` is one of RESOURCES or "cache"
    (the image cache's own disk). Falls back to KNOBS' fixed words for a resource it does not know.
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
    elif resource == "local disk":
        turns += ["keep fewer parts locally (keep_local)"]
        turns += ["lower run.checkpoint_every"] if r.checkpoint_every > 1 else []
    elif resource in ("drive", "cache"):
        smaller = [c for c in CODEC_RATIO_ESTIMATE if CODEC_RATIO_ESTIMATE[c] < CODEC_RATIO_ESTIMATE.get(r.codec, 0)]
        if resource == "drive":
            turns += ["keep fewer run.outputs"] if len(r.outputs) > 1 else []
            turns += ["a float16 run.out_dtype"] if r.out_dtype != "float16" else []
        turns += [f"a compressed run.codec ({' or '.join(sorted(smaller))})"] if smaller else []
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
    "local disk": ["keep_local", "checkpoint_every"],
    "drive": ["out_dtype", "outputs", "codec", "drive_quota"],
}


class _Search:
    """Predictions of some resources (one disk's, or one limit's) with knobs changed, against a target."""

    def __init__(self, budget, resources: tuple[str, ...], target: float):
        self.budget, self.resources, self.target = budget, resources, target
        self.config = budget.config
        self.label = " + ".join(NAMES[r] for r in resources)

    def total(self, resource: str | None = None, **changes) -> int:
        """The predicted total of `resource` (default: the sum of this search's) with `changes` applied."""
        run = {k: v for k, v in changes.items() if k in RUN_KNOBS}
        options = {**self.budget.options, **{k: v for k, v in changes.items() if k in OPTION_KNOBS}}
        if "codec" in run and options.get("codec"):
            options["codec"] = run["codec"]
        totals = (self.budget.with_changes(run, options) if changes else self.budget).totals
        return totals[resource] if resource else sum(totals[r] for r in self.resources)

    def fits(self, **changes) -> bool:
        return self.total(**changes) <= self.target

    def closing(self, knobs: list[str], *, buy: bool) -> tuple[tuple[Suggestion, ...], str]:
        """(the knobs that close the gap alone, with values; else the smallest combination) and a fallback line."""
        single = [getattr(self, knob)() for knob in knobs if knob != "drive_quota"]
        found = [s for s in single if s is not None and s.value != s.current and self.fits(**_changes(s))]
        fallback = ""
        if not found:
            combined, fallback = self.combination([k for k in knobs if k != "drive_quota"])
            found = [combined] if combined is not None else []
        if buy and "drive_quota" in knobs:
            found.append(self.drive_quota())
        return tuple(found), fallback

    def combination(self, knobs: list[str]) -> tuple[Suggestion | None, str]:
        """The fewest knobs that fit together, each at the least change that still fits; else why not."""
        choices = {k: o for k in knobs if (o := self.options(k))}
        names = list(choices)
        for size in range(2, len(names) + 1):
            for subset in itertools.combinations(names, size):
                if not self.fits(**_merged(choices[k][-1] for k in subset)):
                    continue
                chosen: list = []
                for i, knob in enumerate(subset):
                    rest = [choices[k][-1] for k in subset[i + 1:]]
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
        every = _merged(choices[k][-1] for k in names)
        words = " and ".join(f"{_knob_name(k)}={choices[k][-1][0]!r}" for k in names)
        return None, (f"no knob of the run closes it: even {words} together leave "
                      f"{self.label} {self.total(**every) / GB:,.2f} GB, over {self.target / GB:,.2f} GB")

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
        if knob == "keep_local":
            return [(k, {"keep_local": k}) for k in range(self.current("keep_local") - 1, -1, -1)]
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
            return self.budget.options.get(knob, 2 if knob == "keep_local" else None)
        return getattr(self.config.run, knob)

    def batch_size(self) -> Suggestion | None:
        """The largest batch whose VRAM and RAM both fit (what max_batch_size finds)."""
        limits = self.budget.limits
        memory = [r for r in ("vram", "ram") if limits[r] > 0]
        targets = {r: (self.target if r in self.resources else limits[r] * (1 - MARGIN)) for r in memory}

        def fits(b: int) -> bool:
            return all(self.total(r, batch_size=b) <= targets[r] for r in memory)

        current = self.config.run.batch_size
        best = _largest(1, min(current - 1, self.config.run.n_samples), fits)   # never above the run's samples
        if best is None:
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
        best = _largest(1, min(r.checkpoint_every - 1, batches), lambda every: self.fits(**changes(every)))
        if best is None:
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

    def keep_local(self) -> Suggestion | None:
        current = self.current("keep_local")
        best = _largest(0, current - 1, lambda k: self.fits(keep_local=k))
        if best is None:
            return None
        return Suggestion("keep_local", best, current, self._effect(keep_local=best))

    def prefetch(self) -> Suggestion | None:
        return self._first_fitting("prefetch")

    def workers(self) -> Suggestion | None:
        return self._first_fitting("workers")

    def out_dtype(self) -> Suggestion | None:
        return self._first_fitting("out_dtype")

    def outputs(self) -> Suggestion | None:
        """The largest output subset that fits."""
        return self._first_fitting("outputs")

    def codec(self) -> Suggestion | None:
        """The least compressed smaller codec that fits (measured codec_sizes, else estimated ratios; none for a
        measured bytes_per_image of one codec).
        """
        return self._first_fitting("codec")

    def drive_quota(self) -> Suggestion:
        need = self.budget.totals["drive"]
        current = self.budget.options.get("drive_quota_gb")
        value = math.ceil(need / (1 - MARGIN) / GB)
        return Suggestion("drive_quota_gb", value, current, f"a Drive of {value:,} GB holds {need / GB:,.1f} GB "
                          f"with a {MARGIN:.0%} margin")

    def _first_fitting(self, knob: str) -> Suggestion | None:
        for value, changes in self.options(knob):
            if self.fits(**changes):
                return Suggestion(_knob_name(knob), value, self.current(knob), self._effect(**changes))
        return None

    def _smaller_codecs(self) -> list[str]:
        """Codecs smaller than the run's, least compressed first: by the sizes measured on the user's texts
        (the budget's codec_sizes) when given, else by the reference's ratios.
        """
        opts = self.budget.options
        if opts.get("bytes_per_image") is not None or "drive" not in self.resources:
            return []
        codec = opts.get("codec") or self.config.run.codec
        sizes = dict(getattr(opts.get("codec_sizes"), "bytes_per_image", opts.get("codec_sizes")) or {}) \
            or CODEC_RATIO_ESTIMATE
        size = sizes.get(codec, 0.0)
        return sorted((c for c in sizes if sizes[c] < size), key=lambda c: -sizes[c])

    def _effect(self, **changes) -> str:
        total = self.total(**changes)
        verdict = "" if total <= self.target else (", still over" if total > self.target / (1 - MARGIN)
                                                   else f", within the {MARGIN:.0%} margin")
        saves = self.total() - total
        return f"{self.label} {total / GB:,.2f} GB" + (f", saves {saves / GB:,.1f} GB" if saves > 0 else "") + verdict


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
        changes[name.removeprefix("run.")] = _literal(value)
    return changes


def _literal(text: str):
    import ast

    return ast.literal_eval(text)


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with fits(n), for fits true below a threshold and false above it."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
