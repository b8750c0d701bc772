"""What to turn when a budget does not fit: for every resource over its limit, the knobs and the values that fit.

`advise(budget)` returns one `Advice` per resource over its limit (VRAM, RAM, local disk, Drive)
and per Drive limit crossed (items per folder, uploads per day). Each names the knobs that lower
that resource, with the value that fits where one can be computed (the largest batch, the
largest checkpoint or consolidation cadence, keep_local, the Drive size) and the total it gives
where it cannot; a knob is only suggested at a value other than the one already set. Values aim
at (1 - MARGIN) of the limit, as `max_batch_size` and `plan_budget` do. Trade-off: each knob is
searched alone (a few dozen closed-form predictions, well under a millisecond each); combining
them is `plan_budget`'s job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nblib.budget.disk import CODEC_RATIO_ESTIMATE
from nblib.budget.drive import smallest_checkpoint_every
from nblib.budget.resources import FIT_MARGIN, KNOBS
from nblib.config import OUTPUT_CHOICES
from nblib.units import GB

__all__ = [
    "MARGIN", "NAMES", "OPTION_KNOBS", "RUN_KNOBS", "Advice", "Suggestion", "advise", "advise_resource", "knob_words",
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

    def __str__(self) -> str:
        also = f" with {self.also}" if self.also else ""
        return f"{self.knob}={self.value!r}{also} ({self.effect})"


@dataclass(frozen=True)
class Advice:
    """One resource (or Drive limit) over its limit, and what to turn."""

    resource: str
    text: str          # "RAM 33.29 > 11.00 GB" or a Drive limit check's numbers
    suggestions: tuple[Suggestion, ...]
    fallback: str = ""  # the knobs in words when no value could be computed

    def __str__(self) -> str:
        turns = "; or ".join(str(s) for s in self.suggestions) or self.fallback
        return f"{self.text}: {turns}" if turns else self.text


def advise(budget) -> tuple[Advice, ...]:
    """One Advice per resource over its limit (worst first), then one per Drive limit crossed."""
    over = sorted((r for r, u in budget.usage.items() if u > 1), key=lambda r: -budget.usage[r])
    advice = [advise_resource(budget, r) for r in over]
    advice += [Advice(c.name, c.numbers, (), c.knob) for c in budget.drive_limits if c.crossed]
    return tuple(advice)


def advise_resource(budget, resource: str, limit: float | None = None) -> Advice:
    """What lowers `resource` below `limit` (default: the budget's), each knob with the value that fits."""
    limit = budget.limits[resource] if limit is None else limit
    need = budget.totals[resource]
    search = _Search(budget, resource, limit * (1 - MARGIN))
    suggest = {"vram": _vram, "ram": _ram, "local disk": _local_disk, "drive": _drive}[resource]
    return Advice(resource, f"{NAMES[resource]} {need / GB:.2f} > {limit / GB:.2f} GB",
                  tuple(s for s in suggest(search) if s is not None and s.value != s.current),
                  knob_words(budget.config, resource))


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


def _vram(s: _Search) -> list:
    return [s.batch_size(), s.consolidate_every()]


def _ram(s: _Search) -> list:
    return [s.batch_size(), s.checkpoint_every(), s.lower("prefetch", 1), s.lower("workers", 0)]


def _local_disk(s: _Search) -> list:
    return [s.keep_local(), s.checkpoint_every()]


def _drive(s: _Search) -> list:
    r, opts = s.config.run, s.budget.options
    found = [s.fewer_outputs()]
    if r.out_dtype != "float16":
        found.append(s.whole("run.out_dtype", "out_dtype", "float16"))
    codec = opts.get("codec") or r.codec
    smaller = [c for c in CODEC_RATIO_ESTIMATE if CODEC_RATIO_ESTIMATE[c] < CODEC_RATIO_ESTIMATE.get(codec, 0.0)]
    if smaller and opts.get("bytes_per_image") is None:
        found.append(s.whole("run.codec", "codec", min(smaller, key=CODEC_RATIO_ESTIMATE.get)))
    found.append(s.drive_quota())
    return found


class _Search:
    """Predictions of one resource with knobs changed, against a target (the limit less the margin)."""

    def __init__(self, budget, resource: str, target: float):
        self.budget, self.resource, self.target = budget, resource, target
        self.config = budget.config

    def total(self, resource: str | None = None, **changes) -> int:
        """The predicted total of `resource` (default: this one) with `changes` applied."""
        run = {k: v for k, v in changes.items() if k in RUN_KNOBS}
        options = {**self.budget.options, **{k: v for k, v in changes.items() if k in OPTION_KNOBS}}
        if "codec" in run and options.get("codec"):
            options["codec"] = run["codec"]
        return self.budget.with_changes(run, options).totals[resource or self.resource]

    def fits(self, **changes) -> bool:
        return self.total(**changes) <= self.target

    def batch_size(self) -> Suggestion | None:
        """The largest batch whose VRAM and RAM both fit (what max_batch_size finds)."""
        limits = self.budget.limits
        memory = [r for r in ("vram", "ram") if limits[r] > 0]
        targets = {r: (self.target if r == self.resource else limits[r] * (1 - MARGIN)) for r in memory}

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
        current = self.budget.options.get("keep_local", 2)
        best = _largest(0, current - 1, lambda k: self.fits(keep_local=k))
        if best is None:
            return None
        return Suggestion("keep_local", best, current, self._effect(keep_local=best))

    def lower(self, knob: str, value: int) -> Suggestion | None:
        """`knob` at `value` when it is set higher and that alone fits."""
        current = getattr(self.config.run, knob)
        if current <= value or not self.fits(**{knob: value}):
            return None
        return Suggestion(f"run.{knob}", value, current, self._effect(**{knob: value}))

    def whole(self, knob: str, field: str, value) -> Suggestion:
        """`knob` at `value`, with the total it gives (fitting or not)."""
        return Suggestion(knob, value, getattr(self.config.run, field), self._effect(**{field: value}))

    def fewer_outputs(self) -> Suggestion | None:
        """The largest output subset that fits, else the smallest subset there is (with its total)."""
        current = self.config.run.outputs
        totals = {o: self.total(outputs=o) for o in OUTPUT_CHOICES if o != current}
        smaller = {o: t for o, t in totals.items() if t < self.budget.totals[self.resource]}
        if not smaller:
            return None
        fitting = [o for o in OUTPUT_CHOICES if o in smaller and smaller[o] <= self.target]
        choice = fitting[0] if fitting else min(smaller, key=smaller.get)
        return Suggestion("run.outputs", choice, current, self._effect(outputs=choice))

    def drive_quota(self) -> Suggestion:
        need = self.budget.totals["drive"]
        current = self.budget.options.get("drive_quota_gb")
        value = math.ceil(need / (1 - MARGIN) / GB)
        return Suggestion("drive_quota_gb", value, current, f"a Drive of {value:,} GB holds {need / GB:,.1f} GB "
                          f"with a {MARGIN:.0%} margin")

    def _effect(self, **changes) -> str:
        total = self.total(**changes)
        verdict = "" if total <= self.target else (", still over" if total > self.target / (1 - MARGIN)
                                                   else f", within the {MARGIN:.0%} margin")
        return f"{NAMES[self.resource]} {total / GB:,.2f} GB{verdict}"


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
