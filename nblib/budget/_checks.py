"""Argument checks shared by the budget's calculators: ConfigError naming the knob and its range."""
from __future__ import annotations

from nblib.config import PipelineConfig
from nblib.errors import ConfigError, require_choice
from nblib.sdpa import SDPA_BACKENDS, runs_on


def validated(config: PipelineConfig) -> PipelineConfig:
    """The config, validated; ConfigError when it is not a PipelineConfig or a knob is out of range."""
    if not isinstance(config, PipelineConfig):
        raise ConfigError(f"config must be a PipelineConfig, got {type(config).__name__}")
    return config.validate()


def checked_sdpa_backend(name: str | None) -> str:
    """The attention backend to budget for; default "flash"."""
    name = name or "flash"
    require_choice("sdpa_backend", name, SDPA_BACKENDS)
    return name


def require_positive(name: str, value, *, minimum: int = 1, number: bool = False) -> None:
    """ConfigError unless `value` is an int >= minimum (or, with number=True, a number > 0)."""
    ok_type = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        raise ConfigError(f"{name}={value!r} must be {'a number' if number else 'an integer'}"
                          f" >= {minimum}")
    if (value <= 0) if number else (value < minimum):
        raise ConfigError(f"{name}={value} is out of range; allowed: "
                          f"{'> 0' if number else f'>= {minimum}'}")


def attention_on(dev, sdpa_backend: str | None) -> str:
    """The attention backend the device runs: the one forced, else flash, or efficient before sm_80."""
    if sdpa_backend is None and dev.is_gpu and not runs_on("flash", dev.compute_capability):
        return "efficient"
    backend = checked_sdpa_backend(sdpa_backend)
    if dev.is_gpu and not runs_on(backend, dev.compute_capability):
        raise ConfigError(f"sdpa_backend={backend!r} needs sm_80 or newer and a {dev.name} is "
                          f"sm_{dev.compute_capability}; use 'efficient' or 'math'")
    return backend
