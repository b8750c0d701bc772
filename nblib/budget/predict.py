"""Predict the peak VRAM, RAM, local disk and Drive use and the run time of an encode job.

`predict_budget(config, device)` returns a `Budget`: itemized lines (bytes + a one-line reason)
for VRAM, RAM, local disk and Drive, a time estimate from FLOPs, and a verdict naming the limit
that binds. VRAM on a GPU is the trace of the encode loop, replayed from its cached allocation stream
(`nblib.budget.encode_trace`); RAM, disk and time are closed forms, instant and itemized, checked against
measured peaks by `benchmarks/budget_accuracy.py`.
The verdict names every resource over its limit and every Drive limit crossed, each with the
knobs that fit (`nblib.budget.advice`); the widget, the CLI and the notebooks print this one text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from functools import cached_property

from nblib import t4_speed
from nblib.budget._checks import attention_on, require_positive, validated
from nblib.budget.advice import advise
from nblib.budget.devices import Device, device_preset
from nblib.budget.disk import disk_lines
from nblib.budget.drive import FREE_QUOTA_GB, DriveLimitCheck, drive_limit_checks
from nblib.budget.encode_trace import encode_vram, vram_lines
from nblib.budget.memory import Line, flops_per_image, host_memory_lines, model_memory_lines
from nblib.budget.resources import FIT_MARGIN, RESOURCES, fits, largest_fitting, margin_words, room
from nblib.config import PipelineConfig
from nblib.errors import ConfigError
from nblib.units import GB, fmt_bytes, fmt_duration

__all__ = [
    "Budget", "calibrate", "capped_to_samples", "max_batch_size", "predict_budget",
]

@dataclass(frozen=True)
class Budget:
    """A config's predicted peak VRAM, RAM, local disk and Drive use, time, and verdict."""

    config: PipelineConfig
    device: Device
    lines: dict[str, tuple[Line, ...]]   # resource -> lines that sum to its peak
    limits: dict[str, int]               # resource -> bytes available (0: not used)
    flops_per_image: float
    samples_per_s: float
    sdpa_backend: str
    options: dict = field(default_factory=dict, compare=False)  # predict_budget's keyword arguments
    speed: t4_speed.Projection | None = field(default=None, compare=False)  # the sourced range, where there is one

    @property
    def totals(self) -> dict[str, int]:
        return {r: sum(line.bytes for line in self.lines[r]) for r in RESOURCES}

    @property
    def usage(self) -> dict[str, float]:
        """resource -> predicted peak / limit (only resources with a limit)."""
        t = self.totals
        return {r: t[r] / self.limits[r] for r in RESOURCES if self.limits[r] > 0}

    @property
    def binding(self) -> str:
        """The resource closest to (or furthest over) its limit."""
        return max(self.usage.items(), key=lambda kv: kv[1])[0]

    @property
    def over(self) -> tuple[str, ...]:
        """The resources that do not fit (`nblib.budget.resources.fits`: the 10% margin), worst first."""
        t, usage = self.totals, self.usage
        return tuple(sorted((r for r in usage if not fits(t[r], self.limits[r])), key=lambda r: -usage[r]))

    @property
    def fits(self) -> bool:
        """Every resource fits its limit with the margin kept free (the one rule, `resources.fits`)."""
        return not self.over

    @property
    def seconds(self) -> float:
        return self.config.run.n_samples / self.samples_per_s

    @property
    def time_predicted(self) -> bool:
        """Whether the suite stands behind a time here: a sourced range (the T4), a rate calibrated on a measured
        run (`calibrate`), or a GPU's share of peak. A CPU's assumed share is not one (notebook 03: a projected
        3,408 samples/s against 15 measured), so its time is not printed.
        """
        return self.speed is not None or self.options.get("efficiency") is not None or self.device.is_gpu

    @property
    def time_unknown(self) -> str:
        """Why no time is printed ('' when one is): the words a TIME line or a panel shows instead."""
        if self.time_predicted:
            return ""
        return (f"not predicted on {self.device.name} (a CPU's share of its peak moves with its load and threads: "
                f"measure the rate, or pass efficiency=nblib.budget.calibrate(...) of a measured run)")

    def rate_text(self) -> str:
        """The rate as the suite prints it: a sourced range on a T4 (nblib.t4_speed), else one projected figure."""
        return self.speed.rate_text() if self.speed else f"{self.samples_per_s:,.0f} samples/s"

    def hours_text(self) -> str:
        """The run's time as the suite prints it: a sourced range on a T4 (nblib.t4_speed), else one figure."""
        if self.speed:
            return self.speed.hours_text()
        return fmt_duration(self.seconds) if self.time_predicted else f"not predicted on {self.device.name}"

    @property
    def speed_method(self) -> str:
        """How the rate was made, with its label (always a projection: nothing here ran on the device)."""
        if self.speed:
            return f"{self.speed.label}, nblib.t4_speed: {self.speed.method}"
        eff = self.options.get("efficiency")
        share = (f"{eff:.1%} of its peak (calibrated)" if eff is not None
                 else f"{self.device.efficiency:.0%} of its peak")
        return (f"projection: {self.flops_per_image / 1e9:,.2f} GFLOP per image at {share}, "
                f"{self.device.compute_flops / 1e12:,.2f} TFLOP/s on {self.device_words}")

    @property
    def device_words(self) -> str:
        """The device as a sentence names it: 'the t4', 'this machine (cpu)' (never 'the this machine')."""
        return self.device.name if self.device.name.startswith("this ") else f"the {self.device.name}"

    @property
    def headline(self) -> str:
        """Fits or not (`resources.fits`, with its margin), which limit binds and by how much (the chart's title)."""
        margin = margin_words()
        if self.fits:
            r = self.binding
            need, limit = self.totals[r], self.limits[r]
            return (f"fits on {self.device.name} {margin}: {r} binds at {need / GB:.2f} of {limit / GB:.2f} GB "
                    f"({need / limit:.1%}; the target is {1 - FIT_MARGIN:.0%}); time {self.hours_text()}"
                    + (f" ({self.speed.label})" if self.speed else ""))
        usage = self.usage
        over = ", ".join(f"{q} {self.totals[q] / GB:,.2f} of {self.limits[q] / GB:,.2f} GB ({usage[q]:,.1%})"
                         for q in self.over)                  # one form for every resource (newcomer P3)
        return f"does NOT fit on {self.device.name} {margin} (the target is {1 - FIT_MARGIN:.0%} of each limit): {over}"

    @cached_property
    def drive_limits(self) -> tuple[DriveLimitCheck, ...]:
        """Drive's limits beyond bytes (items per folder, uploads per day) against this plan."""
        return drive_limit_checks(self.config, codec=self.options.get("codec"),
                                  bytes_per_image=self.options.get("bytes_per_image"))

    @cached_property
    def advice(self) -> tuple:
        """One nblib.budget.advice.Advice per resource over its limit and per Drive limit crossed."""
        return advise(self)

    def largest_batch(self, limits: dict[str, float] | None = None) -> int:
        """`max_batch_size` of this config, device and options; `limits` replaces a limit ("vram", "ram")."""
        return max_batch_size(self.config, self.device, FIT_MARGIN, limits=limits, **self.options)

    def with_changes(self, run: dict | None = None, options: dict | None = None) -> Budget:
        """The budget of this config with run knobs and predict_budget options changed (advice's search)."""
        config = self.config.replace(**run) if run else self.config
        return predict_budget(config, self.device, **{**self.options, **(options or {})})

    def disk_totals_with(self, run: dict, options: dict) -> dict[str, int]:
        """The local disk and Drive totals of `with_changes(run, options)`, without its VRAM trace or RAM lines
        (the advice's disk searches print only these): the same lines predict_budget sums.
        """
        cfg = capped_to_samples(validated(self.config.replace(**run) if run else self.config))
        lines = _disk_lines(cfg, options.get("codec") or cfg.run.codec, options.get("bytes_per_image"),
                            options.get("codec_sizes"))
        return {r: sum(line.bytes for line in group) for r, group in zip(("local disk", "drive"), lines)}

    @cached_property
    def verdict(self) -> str:
        """One line: the headline, then for every resource over its limit the knobs with values that fit."""
        if not self.advice:
            return self.headline
        joiner = ". " if not self.fits else "; but "
        return self.headline + joiner + ". ".join(str(a) for a in self.advice)

    def table(self) -> str:
        """The itemized lines as aligned text, one block per resource."""
        rows = []
        for r in RESOURCES:
            limit = (f"limit {self.limits[r] / GB:.2f} GB, target {room(self.limits[r]) / GB:.2f} GB"
                     if self.limits[r] else "not used")
            limit += "; the quota's peak, every byte of it uploaded" if r == "drive" else ""
            rows.append(f"{r.upper():<12} {self.totals[r] / GB:>10.3f} GB   ({limit})")
            for line in self.lines[r]:
                rows.append(f"  {line.name:<34} {fmt_bytes(line.bytes):>11}  {line.why}")
        rows.append(f"TIME         {self.time_unknown}" if self.time_unknown else
                    f"TIME         {self.hours_text()}    ({self.flops_per_image / 1e9:.2f} GFLOP/image, "
                    f"{self.rate_text()}{', ' + self.speed.label if self.speed else ''})")
        rows.append("DRIVE LIMITS (besides the quota)")
        rows.extend(f"  {check.numbers}" + ("" if check.crossed else " (ok)") for check in self.drive_limits)
        rows.append(f"VERDICT      {self.verdict}")
        return "\n".join(rows)


def predict_budget(config: PipelineConfig, device: str | Device = "t4", *,
                   sdpa_backend: str | None = None, drive_quota_gb: float = FREE_QUOTA_GB,
                   codec: str | None = None, bytes_per_image: float | None = None,
                   efficiency: float | None = None, precision: str = "fp16",
                   offload: str = "async", codec_sizes=None) -> Budget:
    """Predict peak VRAM, RAM, local disk and Drive use and the run time of an encode job.

    Args:
        config: the pipeline config (model, batch size, cadences, outputs, dtype, codec).
        device: a preset name of `nblib.budget.DEVICES` ("t4", "cpu", ...) or a `Device`.
        sdpa_backend: "math" materializes the attention scores (with the softmax and a bool mask
            of -inf entries: (2 x itemsize + 1) B per score); "efficient"/"flash" do not; default
            "flash" on the CPU and sm_80+ GPUs, "efficient" before sm_80 (a T4); flash or cudnn forced
            on a GPU before sm_80 is refused (ConfigError).
        drive_quota_gb: the Drive space the run may fill (default: the free 15 GB).
        codec: the image cache's codec (default: the config's); bytes_per_image: a measured size
            per cached image, which replaces the codec's estimate.
        codec_sizes: bytes per image per codec measured on the user's texts (an
            `nblib.codec_sizes.CodecSizes`): the cache's size, and the codec the advice
            offers, come from them instead of the reference's ratios (bytes_per_image wins if given).
        efficiency: the share of the device's peak FLOP/s reached (`calibrate`); default the preset's, or on
            a T4 nblib.t4_speed's sourced range (`Budget.speed`, its mid as samples_per_s).
        precision: "fp16" (autocast, the default on CUDA), "bf16" or "fp32"; offload: "async" or
            "consolidate". Both shape the VRAM lines: the trace of the encode loop (`encode_vram`).

    Batch and part sizes are capped at the run's n_samples first, as the run caps them
    (`capped_to_samples`): a batch of 10^9 over 400 images costs what a batch of 400 does.

    Returns:
        A `Budget`: itemized lines per resource, totals, limits, time, verdict and advice.

    Raises:
        ConfigError naming the knob out of range.
    """
    given = validated(config)
    cfg = capped_to_samples(given)                   # what the run really holds; the Budget keeps `given`
    dev = device_preset(device)
    backend = attention_on(dev, sdpa_backend)
    require_positive("drive_quota_gb", drive_quota_gb, number=True)
    m, r = cfg.model, cfg.run
    codec_arg, codec = codec, codec or r.codec
    if precision not in ("fp16", "fp32", "bf16"):
        raise ConfigError(f"precision={precision!r} is unknown; choose fp16, bf16 or fp32")
    if offload not in ("async", "consolidate"):
        raise ConfigError(f"offload={offload!r} is unknown; choose 'async' or 'consolidate'")
    if dev.is_gpu:            # the one trace of the encode loop (cached: nblib.budget.encode_trace)
        vram = vram_lines(encode_vram(cfg, dev, precision=precision, sdpa_backend=backend, offload=offload))
        ram = host_memory_lines(cfg, cuda=True)
    else:
        vram = ()
        ram = (*host_memory_lines(cfg, cuda=False), *model_memory_lines(cfg, sdpa_backend=backend))
    local, drive = _disk_lines(cfg, codec, bytes_per_image, codec_sizes)
    flops = flops_per_image(m)
    speed = _sourced_speed(dev, flops, precision, given.run.n_samples) if efficiency is None else None
    eff = dev.efficiency if efficiency is None else efficiency
    rate = speed.samples_per_s.mid if speed else dev.compute_flops * eff / flops
    return Budget(
        config=given, device=dev,
        lines={"vram": tuple(vram), "ram": tuple(ram), "local disk": local, "drive": drive},
        limits={"vram": dev.vram_bytes, "ram": dev.ram_bytes, "local disk": dev.disk_bytes,
                "drive": int(drive_quota_gb * GB)},
        flops_per_image=flops, samples_per_s=rate, sdpa_backend=backend,
        options={"sdpa_backend": sdpa_backend, "drive_quota_gb": drive_quota_gb, "codec": codec_arg,
                 "bytes_per_image": bytes_per_image, "efficiency": efficiency,
                 "precision": precision, "offload": offload, "codec_sizes": codec_sizes},
        speed=speed)


def _sourced_speed(dev: Device, flops: float, precision: str, n_samples: int) -> t4_speed.Projection | None:
    """nblib.t4_speed's range for a device that has one (the T4); bf16 takes fp32's (sm_75 has no bf16 tensor cores)."""
    if not dev.sourced_speed:
        return None
    speed = t4_speed.project(flops, "fp16" if precision == "fp16" else "fp32", n_samples=n_samples,
                             counted_by=t4_speed.TRM_COUNTED_BY)
    if precision == "bf16":
        speed = dataclass_replace(speed, method=speed.method + "; bf16 has no tensor cores on a T4 (sm_75): "
                                                               "fp32's range")
    return speed


def _disk_lines(cfg: PipelineConfig, codec: str, bytes_per_image: float | None, codec_sizes) -> tuple:
    """The local disk and Drive lines of a capped config: the cache sized as given, measured, else estimated."""
    if bytes_per_image is None and codec_sizes is not None:
        bytes_per_image = codec_sizes.bytes_per_image.get(codec)
    return disk_lines(cfg, codec=codec, bytes_per_image=bytes_per_image)


def capped_to_samples(config: PipelineConfig) -> PipelineConfig:
    """The config with batch_size, checkpoint_every and consolidate_every no larger than the run holds.

    A run never holds more than n_samples in a batch or a part, so neither does its budget, nor
    any value the budget advises.
    """
    r = config.run
    batch = min(r.batch_size, r.n_samples)
    every = min(r.checkpoint_every, -(-r.n_samples // batch))
    cons = min(r.consolidate_every, every)
    every = -(-every // cons) * cons                 # a multiple of consolidate_every, as validate() wants
    if (batch, every, cons) == (r.batch_size, r.checkpoint_every, r.consolidate_every):
        return config
    return config.replace(batch_size=batch, checkpoint_every=every, consolidate_every=cons)


def calibrate(device: str | Device, measured_samples_per_s: float,
              config: PipelineConfig) -> float:
    """The efficiency (share of peak FLOP/s) a measured run reached; pass it to predict_budget."""
    require_positive("measured_samples_per_s", measured_samples_per_s, number=True)
    dev = device_preset(device)
    return measured_samples_per_s * flops_per_image(validated(config).model) / dev.compute_flops


def max_batch_size(config: PipelineConfig, device: str | Device = "t4", margin: float = FIT_MARGIN,
                   limits: dict[str, float] | None = None, **predict_kwargs) -> int:
    """The largest batch, at most the run's n_samples, whose predicted VRAM (GPU) and RAM fit in
    (1 - margin) of the device (`resources.fits`); `limits` replaces the device's limit of a resource
    ("vram", "ram"), as a refusal's advice does with what is free on this machine.
    """
    limits = limits or {}
    cfg, dev = validated(config), device_preset(device)
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin} is out of range; allowed: 0 <= margin < 1")

    def fit(b: int) -> bool:
        budget = predict_budget(cfg.replace(batch_size=b), dev, **predict_kwargs)
        return all(fits(budget.totals[r], limits.get(r, budget.limits[r]), margin) for r in ("vram", "ram")
                   if budget.limits[r] > 0)

    return largest_fitting(fit, min(1 << 20, cfg.run.n_samples))   # a batch never holds more than the run's samples
