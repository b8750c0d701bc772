"""An encode run's budget over several ranks: per rank VRAM and RAM, host RAM, the shared folder, time.

Computed from `nblib.budget.predict_budget` of the whole run in one process: each rank holds the
same model, batches and part buffers as one process, the shared folder holds every part once
(plus one in flight per extra rank), and the time is a projection divided by the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from nblib import budget
from nblib.budget import KNOBS, RUNTIME_RAM_CPU, RUNTIME_RAM_CUDA
from nblib.budget.resources import fits, shortfall_words
from nblib.config import PipelineConfig
from nblib.errors import BudgetExceeded
from nblib.units import GB, fmt_bytes, fmt_duration, fmt_duration_range

__all__ = ["RankBudget", "check_host_ram", "rank_budget"]


@dataclass(frozen=True)
class RankBudget:
    """An encode run's budget over `world_size` ranks: per rank VRAM and RAM, host RAM, shared Drive, time."""

    single: Any                # the Budget of the whole run in one process (nblib.budget.Budget)
    world_size: int
    ranks_per_host: int
    part_bytes: int            # one part's outputs: each rank has one in flight on the shared folder

    @property
    def vram_per_rank(self) -> int:
        return self.single.totals["vram"]

    @property
    def ram_per_rank(self) -> int:
        return self.single.totals["ram"]

    @property
    def host_ram(self) -> int:
        return self.ram_per_rank * self.ranks_per_host

    @property
    def drive_total(self) -> int:
        """The shared folder holds every part once, plus one part in flight per extra rank."""
        return self.single.totals["drive"] + (self.world_size - 1) * self.part_bytes

    @property
    def seconds(self) -> float:
        """A projection: one process's time divided by the ranks (perfect scaling, no straggler)."""
        return self.single.seconds / self.world_size

    @property
    def over(self) -> list[str]:
        """What does not fit (the one rule, resources.fits: a 10% margin): VRAM per rank, RAM per host, the folder."""
        dev, limits = self.single.device, self.single.limits
        return [name for name, need, limit, counted in (
            ("VRAM per rank", self.vram_per_rank, limits["vram"], dev.is_gpu),
            ("RAM per host", self.host_ram, limits["ram"], True),
            ("shared folder", self.drive_total, limits["drive"], True)) if counted and not fits(need, limit)]

    @property
    def fits(self) -> bool:
        return not self.over

    def __str__(self) -> str:
        dev, limits = self.single.device, self.single.limits
        vram = f"{fmt_bytes(self.vram_per_rank)} of {fmt_bytes(limits['vram'])}" if dev.is_gpu else "none (CPU)"
        return "\n".join([
            f"{self.world_size} ranks on {dev.name} ({self.ranks_per_host} per host), "
            f"{self.single.config.run.n_samples:,} samples",
            f"  VRAM per rank     {vram}",
            f"  RAM per rank      {fmt_bytes(self.ram_per_rank)}; per host x{self.ranks_per_host}: "
            f"{fmt_bytes(self.host_ram)} of {fmt_bytes(limits['ram'])}",
            f"  shared folder     {fmt_bytes(self.drive_total)} of {fmt_bytes(limits['drive'])} "
            f"(every part once + {self.world_size - 1} more in flight)",
            f"  time              {self._time()} = {fmt_duration(self.single.seconds)} / "
            f"{self.world_size} ranks (perfect scaling{self._source()})",
            f"  verdict           {'fits' if self.fits else 'does NOT fit: ' + ', '.join(self.over)}"])

    def _time(self) -> str:
        """The time per rank, with nblib.t4_speed's range (divided as the mid is) where the device has one."""
        speed, n = self.single.speed, self.world_size
        if not speed:
            return fmt_duration(self.seconds)
        return fmt_duration_range(speed.hours.low * 3600 / n, self.seconds, speed.hours.high * 3600 / n)

    def _source(self) -> str:
        return f"; {self.single.speed.label}, nblib.t4_speed's range" if self.single.speed else ""


def rank_budget(config: PipelineConfig, device: str = "t4", world_size: int = 1, *,
                ranks_per_host: int | None = None, **predict_kwargs) -> RankBudget:
    """The budget of an encode run over `world_size` ranks (`ranks_per_host` of them per machine): see the module."""
    budget.require_positive("world_size", world_size)
    per_host = world_size if ranks_per_host is None else ranks_per_host
    budget.require_positive("ranks_per_host", per_host)
    single = budget.predict_budget(config, device, **predict_kwargs)
    r = single.config.run
    part = min(r.checkpoint_every * r.batch_size, r.n_samples) * budget.output_bytes_per_image(single.config)
    return RankBudget(single, world_size, min(per_host, world_size), part)


def check_host_ram(config: PipelineConfig, ranks_per_host: int, device: str | None = None) -> None:
    """BudgetExceeded when the ranks of this host together do not fit the RAM available plus what they hold
    (`resources.fits`, the preflight's rule).
    """
    cuda = device is not None and str(device).startswith("cuda")
    plan = rank_budget(config, "t4" if cuda else "cpu", ranks_per_host, ranks_per_host=ranks_per_host)
    runtime = RUNTIME_RAM_CUDA if cuda else RUNTIME_RAM_CPU
    need = (plan.ram_per_rank - runtime) * ranks_per_host      # each rank already holds its runtime
    available = psutil.virtual_memory().available
    held = runtime * ranks_per_host
    if not fits(need + held, available + held):
        raise BudgetExceeded(
            f"{ranks_per_host} ranks on this host need {need / GB:.2f} GB more RAM "
            f"({(plan.ram_per_rank - runtime) / GB:.2f} GB each) but {available / GB:.2f} GB is available: "
            f"{shortfall_words(need + held, available + held, 'of RAM')}; "
            f"start fewer ranks per host (--nproc_per_node) or {KNOBS['ram']}")
