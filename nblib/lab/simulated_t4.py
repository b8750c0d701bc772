"""Notebooks 01 and 03 on the simulated T4: predicted against simulated VRAM, and the T4's time.

No GPU is lent to this project. `simulated_vram` puts the budget's VRAM beside the simulated T4's
(nblib.simulate: the real encoder on a fake CUDA device, PyTorch's caching-allocator policy), so a
notebook can show predicted / simulated next to predicted / measured RSS. `full_run_time` is the
T4 time every notebook quotes: nblib.t4_speed's range (public T4 measurements with their sources,
a projection) through the budget, beside the simulated T4's roofline, a ceiling it must stay under.
What a simulation sees: every tensor the code allocates and every kernel it launches. What it
cannot see: the CUDA context (an assumed 0.4 GB), kernel scratch besides cuBLAS's workspace,
launch overheads and clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from nblib import budget, t4_speed
from nblib.config import PipelineConfig, preset

LABEL = "simulated"
CAN_SEE = ("every tensor the real encoder code and the encode loop allocate on the device, the caching "
           "allocator's segments (PyTorch's default policy), cuBLAS's workspace, and every kernel's FLOPs and bytes")
CANNOT_SEE = ("the CUDA context (300-500 MB on a T4: an assumption, 0.4 GB in the budget), other kernels' scratch, "
              "launch overheads, clocks and thermal limits: a simulated time is a roofline, a ceiling, not measured")


@dataclass(frozen=True)
class VramRow:
    """One batch size: the budget's VRAM (CUDA context excluded) and the simulated T4's reserved bytes."""

    batch_size: int
    predicted: int
    simulated: int

    @property
    def ratio(self) -> float:
        return self.simulated / self.predicted


def simulated_vram(config: PipelineConfig, batch_sizes, *, precision: str = "fp16",
                   offload: str = "async") -> list[VramRow]:
    """Predicted (budget, without the CUDA context) and simulated max_memory_reserved on a T4 per batch size."""
    from nblib.simulate import simulate_encode

    t4 = budget.device_preset("t4")
    rows = []
    for b in batch_sizes:
        cfg = config.replace(batch_size=b)
        predicted = budget.predict_budget(cfg, t4, precision=precision, offload=offload)
        sim = simulate_encode(cfg, t4, precision=precision, offload=offload)
        rows.append(VramRow(b, predicted.totals["vram"] - t4.cuda_context_bytes, sim.max_reserved))
    return rows


def vram_table(measured_rows, vram_rows: list[VramRow]) -> str:
    """Predicted vs measured RSS and predicted vs simulated T4 VRAM, side by side, each with its ratio.

    measured_rows: (batch, predicted bytes, measured bytes) of the measured forward pass.
    """
    head = (f"{'batch':>6} | {'predicted':>10} {'measured RSS':>13} {'ratio':>6} | "
            f"{'predicted':>10} {'simulated T4':>13} {'ratio':>6}")
    lines = [f"{'':>6} | {'forward-pass peak, this machine':^31} | {'T4 VRAM reserved (' + LABEL + ')':^31}", head]
    for (b, p, m), v in zip(measured_rows, vram_rows):
        lines.append(f"{b:>6} | {p / 1e6:>7.1f} MB {m / 1e6:>10.1f} MB {m / p:>6.2f} | "
                     f"{v.predicted / 1e6:>7.1f} MB {v.simulated / 1e6:>10.1f} MB {v.ratio:>6.2f}")
    lines.append("T4 VRAM without the CUDA context; simulated: " + CAN_SEE + ". Not seen: " + CANNOT_SEE + ".")
    return "\n".join(lines)


@dataclass(frozen=True)
class T4Time:
    """The full run's time on a T4: nblib.t4_speed's sourced range, beside the simulated T4's roofline ceiling."""

    speed: t4_speed.Projection          # the budget's T4 range (public measurements; a projection)
    roofline_samples_per_s: float       # the simulated T4's kernels on a roofline: a ceiling (simulated)

    @property
    def samples_per_s(self) -> float:
        return self.speed.samples_per_s.mid

    def __str__(self) -> str:
        s = self.speed
        return (f"T4 time of the full run ({s.n_samples:,} images, seed_t4, {s.precision} autocast): "
                f"{s.hours_text()} at {s.rate_text()} ({s.label})\n"
                f"method: {s.method}; sources: nblib.t4_speed.SOURCES; not measured on a GPU\n"
                f"check: the simulated T4's {s.precision} kernels on a roofline, a ceiling no run beats: "
                f"{self.roofline_samples_per_s:,.0f} samples/s ({LABEL}); the range's high end is "
                f"{s.samples_per_s.high / self.roofline_samples_per_s:.0%} of it")


def full_run_time(config: PipelineConfig | None = None, precision: str = "fp16") -> T4Time:
    """The T4's time for the reference's full run: the budget's sourced range, and the simulated roofline beside it."""
    from nblib.simulate import simulate_encode
    from nblib.simulate.roofline import roofline

    cfg = config or preset("seed_t4")
    speed = budget.predict_budget(cfg, "t4", precision=precision).speed
    run = simulate_encode(cfg, "t4", precision=precision, batches=1)
    return T4Time(speed, roofline(run.kernels, cfg.run.batch_size, "t4").samples_per_s)
