"""A pipeline's knobs as frozen dataclasses, and the named presets.

`ModelConfig` is the TRM vision encoder's shape, `RunConfig` is how a streaming job runs over a
dataset, `PipelineConfig` bundles both with a name. Presets: `seed_t4` (the numbers of the
streaming analysis), `t4` (the same model on a demo-sized dataset) and `smoke` (tiny, for CPU
and CI). Configuration is data: change a knob with `cfg.replace(batch_size=64)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from nblib.errors import ConfigError

__all__ = [
    "CODECS", "OUTPUT_CHOICES", "OUTPUT_DTYPES", "OUTPUT_NAMES", "PROFILES", "ModelConfig", "PipelineConfig",
    "RunConfig", "for_profile", "named_config", "preset", "preset_names", "table",
]

OUTPUT_NAMES = ("sketches", "checksums", "children")
# the subsets of outputs worth comparing when disk is the wall, largest first
OUTPUT_CHOICES = (("sketches", "checksums", "children"), ("sketches", "children"),
                  ("sketches", "checksums"), ("sketches",), ("checksums",))
OUTPUT_DTYPES = ("float16", "float32")
CODECS = ("raw", "png", "zlib", "zstd")  # the cache's registry: nblib.cache.codecs.CODECS
PROFILES = ("smoke", "t4", "full")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the TRM vision encoder: patches -> recursive blocks -> capsules -> children."""

    image_size: int = 224
    patch: int = 16
    dim: int = 768
    heads: int = 8
    layers: int = 2
    H_cycles: int = 2
    L_cycles: int = 3
    capsules: int = 12
    children: int = 4
    checksum_dim: int = 32
    mlp_ratio: int = 4

    @property
    def tokens(self) -> int:
        """Patch tokens per image: (image_size / patch) ** 2."""
        return (self.image_size // self.patch) ** 2

    @property
    def passes(self) -> int:
        """Passes through the shared block stack per image: H_cycles x (L_cycles + 1)."""
        return self.H_cycles * (self.L_cycles + 1)


@dataclass(frozen=True)
class RunConfig:
    """How a streaming job runs: dataset size, batching, loader, output and checkpoint cadence."""

    n_samples: int = 1_907_747
    batch_size: int = 192
    workers: int = 2
    prefetch: int = 2
    consolidate_every: int = 50
    checkpoint_every: int = 200
    out_dtype: str = "float16"
    outputs: tuple[str, ...] = OUTPUT_NAMES
    seed: int = 0
    codec: str = "raw"
    shard_mb: int = 400

    @property
    def n_batches(self) -> int:
        return -(-self.n_samples // self.batch_size)


@dataclass(frozen=True)
class PipelineConfig:
    """A named model + run pair: everything a notebook or CLI verb needs to size a job."""

    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def replace(self, **changes) -> PipelineConfig:
        """A copy with knobs changed by their field names (model or run), validated."""
        model_names = {f.name for f in fields(ModelConfig)}
        run_names = {f.name for f in fields(RunConfig)}
        model_changes, run_changes, top = {}, {}, {}
        for key, value in changes.items():
            if key in model_names:
                model_changes[key] = value
            elif key in run_names:
                run_changes[key] = tuple(value) if key == "outputs" else value
            elif key == "name":
                top[key] = value
            else:
                known = ", ".join(sorted(model_names | run_names))
                raise ConfigError(f"unknown config field {key!r}; known fields: {known}")
        cfg = PipelineConfig(
            name=top.get("name", self.name),
            model=dataclasses.replace(self.model, **model_changes),
            run=dataclasses.replace(self.run, **run_changes),
        )
        return cfg.validate()

    def validate(self) -> PipelineConfig:
        """Self if every field is in range, else a ConfigError naming the first one out and the allowed range."""
        m, r = self.model, self.run
        for section, obj in (("model", m), ("run", r)):
            for f in (f for f in fields(obj) if f.type in ("int", int)):
                value = getattr(obj, f.name)
                minimum = 0 if f.name in ("workers", "seed") else 1
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{section}.{f.name}={value!r} must be an integer >= {minimum}")
                if value < minimum:
                    raise ConfigError(f"{section}.{f.name}={value} is out of range; allowed: integers >= {minimum}")
        if r.seed >= SEED_LIMIT:
            raise ConfigError(f"run.seed={r.seed} is out of range; allowed: integers from 0 to 2**64 - 1 "
                              f"(torch.manual_seed and numpy's SeedSequence take no larger seed)")
        if m.image_size % m.patch:
            raise ConfigError(
                f"model.image_size={m.image_size} is not divisible by model.patch={m.patch}; "
                f"pick an image size that is a multiple of the patch "
                f"(e.g. {m.image_size // m.patch * m.patch or m.patch})")
        if m.dim % m.heads:
            raise ConfigError(
                f"model.dim={m.dim} is not divisible by model.heads={m.heads}; "
                f"use heads in {{{', '.join(str(h) for h in range(1, 65) if m.dim % h == 0)}}}")
        if m.capsules > m.tokens:
            raise ConfigError(f"model.capsules={m.capsules} exceeds the {m.tokens} patch tokens; allowed range is "
                              f"1..{m.tokens}")
        if r.out_dtype not in OUTPUT_DTYPES:
            raise ConfigError(f"run.out_dtype={r.out_dtype!r} is not supported; choose one of {OUTPUT_DTYPES}")
        if not r.outputs or any(o not in OUTPUT_NAMES for o in r.outputs) or len(set(r.outputs)) != len(r.outputs):
            raise ConfigError(f"run.outputs={r.outputs!r}: pick one or more distinct names of {OUTPUT_NAMES}")
        if r.checkpoint_every % r.consolidate_every:
            raise ConfigError(
                f"run.checkpoint_every={r.checkpoint_every} is not a multiple of "
                f"run.consolidate_every={r.consolidate_every}; make it one (e.g. "
                f"{max(1, r.checkpoint_every // r.consolidate_every) * r.consolidate_every})")
        if r.codec not in CODECS:
            raise ConfigError(f"run.codec={r.codec!r} is not supported; choose one of {CODECS}")
        return self

    def to_dict(self) -> dict:
        return {"name": self.name, "model": dataclasses.asdict(self.model),
                "run": {**dataclasses.asdict(self.run), "outputs": list(self.run.outputs)}}

    @classmethod
    def from_dict(cls, d: dict) -> PipelineConfig:
        run = dict(d.get("run", {}))
        if "outputs" in run:
            run["outputs"] = tuple(run["outputs"])
        try:
            return cls(name=d.get("name", "custom"), model=ModelConfig(**d.get("model", {})),
                       run=RunConfig(**run)).validate()
        except TypeError as exc:
            raise ConfigError(f"config dict has unknown fields: {exc}") from None


def preset(name: str) -> PipelineConfig:
    """The named preset: seed_t4, t4 or smoke."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(_PRESETS)}")
    return _PRESETS[name].validate()


def named_config(name: str) -> PipelineConfig:
    """The config a profile (smoke | t4 | full) or a preset name runs: what every verb's --profile means."""
    try:
        return for_profile(name)
    except ConfigError:
        return preset(name)


def for_profile(profile: str) -> PipelineConfig:
    """The preset a profile runs: smoke -> smoke, t4 -> t4, full -> seed_t4."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; set NBLIB_PROFILE to one of: {', '.join(PROFILES)}")
    return preset({"smoke": "smoke", "t4": "t4", "full": "seed_t4"}[profile])


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


SEED_LIMIT = 2 ** 64  # torch.manual_seed and numpy's SeedSequence take seeds below this


_PRESETS = {    # frozen, so one instance each serves every caller
    "seed_t4": PipelineConfig(name="seed_t4"),
    "t4": PipelineConfig(name="t4", run=RunConfig(n_samples=20_000, consolidate_every=10, checkpoint_every=20)),
    "smoke": PipelineConfig(name="smoke",
                            model=ModelConfig(image_size=64, patch=16, dim=64, heads=4, layers=2, H_cycles=2,
                                              L_cycles=3, capsules=4, children=2, checksum_dim=8),
                            run=RunConfig(n_samples=512, batch_size=32, workers=0, prefetch=2, consolidate_every=2,
                                          checkpoint_every=4, shard_mb=1)),
}


def table(*configs: PipelineConfig) -> str:
    """A text table of every knob, one column per config (e.g. the presets side by side)."""
    configs = configs or tuple(preset(n) for n in _PRESETS)
    rows = [("", [c.name for c in configs])]
    rows += [(f"model.{f.name}", [f"{getattr(c.model, f.name):,}" for c in configs]) for f in fields(ModelConfig)]
    rows += [("model.tokens", [f"{c.model.tokens:,}" for c in configs])]
    for f in fields(RunConfig):
        values = [getattr(c.run, f.name) for c in configs]
        rows.append((f"run.{f.name}", [",".join(v) if isinstance(v, tuple) else
                                       f"{v:,}" if isinstance(v, int) else str(v) for v in values]))
    width = max(len(name) for name, _ in rows)
    col = max(len(v) for _, vals in rows for v in vals)
    return "\n".join(f"{name:<{width}}  " + "  ".join(f"{v:>{col}}" for v in vals) for name, vals in rows)
