"""Scaling encode out over processes: who this one is, which parts it encodes, and meeting the others.

A `World` says what this process is in a run, one small type per role, kept in a registry (`ROLES`) instead
of one class comparing a role string: the only one (`Single`), a rank of a `torchrun` launch (`Rank`), one
of N plain processes sharing only a folder (`Shard`, `--shard I/N`), or the one that merges their parts
(`Consolidator`). How parts are split, who writes what, and what must be shared: docs/distributed.md.
A barrier with a timeout stops every rank with a message when one dies, never a hang. torch is imported
only when a process group is joined.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from nblib.config import PipelineConfig
from nblib.encode.layout import part_name, parts_dir
from nblib.encode.protocols import PartStore
from nblib.encode.rank_budget import check_host_ram, rank_budget
from nblib.encode.ranks import (
    RANKS_FOLDER,
    RECORD_KIND,
    RECORD_VERSION,
    DurableProgress,
    RankRecord,
    durable_parts_shared,
    part_writes,
    read_records,
    split,
)
from nblib.errors import ConfigError, PeerLost, StateError
from nblib.lock import launch_id
from nblib.store.parts import PartInfo, VerifyLevel
from nblib.units import fmt_duration, fmt_exception

__all__ = [
    "DEFAULT_TIMEOUT_S", "RANKS_FOLDER", "RECORD_KIND", "RECORD_VERSION", "ROLES", "SINGLE", "TIMEOUT_ENV",
    "Consolidator", "PeerLost", "Rank", "Shard", "Single", "World", "check_host_ram", "join", "parse_shard",
    "part_writes", "rank_budget", "read_records", "split", "world_from_environment",
]

TIMEOUT_ENV = "NBLIB_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0         # how long a rank waits at a barrier for the others


@dataclass(frozen=True)
class World:
    """This process's place in a run; the defaults are those every role shares (see the roles below)."""

    role: ClassVar[str]
    writes_manifest: ClassVar[bool] = False   # only a single process writes the run manifest as it goes
    consolidates: ClassVar[bool] = False      # the process that merges the parts (one per run)
    rank: int = 0
    size: int = 1
    device: str | None = None          # the device this process encodes on (None: encode picks)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        """True unless this is a plain single-process run (which writes its manifest as it goes)."""
        return not self.writes_manifest

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}/{self.size}"

    @property
    def launch(self) -> str | None:
        """Shared by the processes of one launch (the run lock's identity); None: this process alone."""
        return None

    @property
    def lock_environ(self) -> dict | None:
        """The environment the run lock's identity is read from (None: this process's own)."""
        return None

    @property
    def reports(self) -> bool:
        """True when this process prints the run's report (the other ranks of a launch stay quiet)."""
        return self.consolidates

    def assign(self, pending: list[int], n_parts: int, fingerprints: dict | None = None) -> list[int]:
        """This process's share of the parts not yet durable (`pending`); it touches no store."""
        raise NotImplementedError

    def durable_parts(self, store: PartStore, n_parts: int, verify: VerifyLevel) -> list[PartInfo]:
        """The verified parts of the run folder: those another process writes now are not reported."""
        return durable_parts_shared(store, verify, {part_name(k) for k in range(n_parts)})

    def record(self, run_dir: str | Path, assigned: list[int]) -> RankRecord | None:
        """Start this process's record under run_dir/ranks of the parts it was given (None: no record)."""
        return RankRecord(Path(run_dir), self.role, self.rank, self.size, self.launch, assigned)

    def barrier(self, what: str) -> None:
        """Wait until every process of the launch is here (only ranks meet)."""

    def refuse_mirror(self) -> None:
        """ConfigError unless single: each process's mirror thread would copy the others' parts too."""
        raise ConfigError(
            f"--mirror is for one process; with several ({self.label}) write --out on the folder "
            f"every process shares (the Drive or network folder itself) and leave --mirror out")

    def progress(self, run_dir: str | Path, n_parts: int, enabled: bool = True):
        """A bar over the whole run's durable parts, where this role shows one; nothing elsewhere."""
        return contextlib.nullcontext()

    def preflight(self, config: PipelineConfig, device: str | None = None) -> None:
        """Checks beyond this process's own budget (the host's RAM for all its ranks)."""

    def close(self) -> None:
        """Leave the process group (a torchrun rank); nothing for the other roles."""


@dataclass(frozen=True)
class Single(World):
    """The only process of a run: encodes every pending part, writes the manifest as it goes, merges."""

    role: ClassVar[str] = "single"
    writes_manifest: ClassVar[bool] = True
    consolidates: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return "single process"

    def assign(self, pending: list[int], n_parts: int, fingerprints: dict | None = None) -> list[int]:
        return list(pending)

    def durable_parts(self, store: PartStore, n_parts: int, verify: VerifyLevel) -> list[PartInfo]:
        return store.list_parts(verify=verify)

    def record(self, run_dir: str | Path, assigned: list[int]) -> None:
        return None

    def refuse_mirror(self) -> None:
        return None


@dataclass(frozen=True)
class Shard(World):
    """Shard `rank` of `size` plain processes sharing a folder (`--shard I/N`): block I of all the parts."""

    role: ClassVar[str] = "shard"

    @property
    def launch(self) -> str:
        return f"nblib-shards-of-{self.size}"

    @property
    def lock_environ(self) -> dict:
        """The shards of N share one launch identity, so they share the run lock."""
        return {"TORCHELASTIC_RUN_ID": self.launch}

    @property
    def reports(self) -> bool:
        return True

    def assign(self, pending: list[int], n_parts: int, fingerprints: dict | None = None) -> list[int]:
        left = set(pending)
        return [k for k in split(range(n_parts), self.rank, self.size) if k in left]

    def durable_parts(self, store: PartStore, n_parts: int, verify: VerifyLevel) -> list[PartInfo]:
        block = split(range(n_parts), self.rank, self.size)   # the other shards' parts may be in flight
        return durable_parts_shared(store, verify, {part_name(k) for k in block})

    def progress(self, run_dir: str | Path, n_parts: int, enabled: bool = True):
        return _durable_bar(run_dir, n_parts, self.label) if enabled else contextlib.nullcontext()


@dataclass(frozen=True)
class Consolidator(World):
    """The process that only merges the parts the shards wrote (`--consolidate`): encodes none."""

    role: ClassVar[str] = "consolidate"
    consolidates: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return "consolidation"

    def assign(self, pending: list[int], n_parts: int, fingerprints: dict | None = None) -> list[int]:
        return []

    def record(self, run_dir: str | Path, assigned: list[int]) -> None:
        return None


@dataclass(frozen=True)
class Rank(World):
    """Rank `rank` of `size` of a torchrun launch: block `rank` of rank 0's pending parts; rank 0 merges."""

    role: ClassVar[str] = "rank"
    local_rank: int = 0
    local_size: int = 1
    launch_name: str | None = None     # torchrun's run id and rendezvous address
    group: Any = field(default=None, compare=False, repr=False)  # the gloo group of the launch

    @property
    def consolidates(self) -> bool:   # type: ignore[override]
        return self.rank == 0

    @property
    def launch(self) -> str | None:
        return self.launch_name

    def assign(self, pending: list[int], n_parts: int, fingerprints: dict | None = None) -> list[int]:
        """Block `rank` of rank 0's pending list, after a barrier (nobody writes while another lists)."""
        return split(self._agree(pending, n_parts, fingerprints), self.rank, self.size)

    def barrier(self, what: str) -> None:
        """PeerLost when a rank does not come in time."""
        if self.size == 1:
            return
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as exc:     # DistBackendError, gloo timeouts and closed connections
            raise self._lost(what, exc) from exc

    def progress(self, run_dir: str | Path, n_parts: int, enabled: bool = True):
        """Rank 0's bar over all ranks' parts."""
        shows = enabled and self.rank == 0
        return _durable_bar(run_dir, n_parts, self.label) if shows else contextlib.nullcontext()

    def preflight(self, config: PipelineConfig, device: str | None = None) -> None:
        """The host's RAM for all of its ranks (local rank 0 checks); the rest is per rank already."""
        if self.local_rank == 0 and self.local_size > 1:
            check_host_ram(config, self.local_size, device)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _agree(self, pending: list[int], n_parts: int, fingerprints: dict | None) -> list[int]:
        """Rank 0's pending parts and inputs, broadcast; StateError when this rank's inputs differ."""
        if self.size == 1:
            return list(pending)
        import torch.distributed as dist

        payload = [(n_parts, fingerprints, list(pending))]
        try:
            dist.broadcast_object_list(payload, src=0, group=self.group)
        except RuntimeError as exc:
            raise self._lost("agreeing on the parts to encode", exc) from exc
        theirs_n, theirs_fp, theirs_pending = payload[0]
        if (theirs_n, theirs_fp) != (n_parts, fingerprints):
            raise StateError(
                f"rank {self.rank} has other inputs than rank 0 ({n_parts} parts, fingerprints {fingerprints} vs "
                f"{theirs_n} parts, {theirs_fp}): every rank must read the same cache with the same "
                f"settings and weights; pass the same arguments to every node")
        self.barrier("the start, after every rank listed the durable parts")
        return list(theirs_pending)

    def _lost(self, what: str, exc: BaseException) -> PeerLost:
        first = fmt_exception(exc)
        return PeerLost(
            f"rank {self.rank} of {self.size} gave up waiting for the other ranks at {what} ({first}): "
            f"a rank died, or did not arrive within {fmt_duration(self.timeout_s)}. Every finished part "
            f"is kept: rerun the same command (any number of ranks) to resume. If a rank is only slow, "
            f"raise {TIMEOUT_ENV} (now {self.timeout_s:g} s)")


ROLES: dict[str, type[World]] = {cls.role: cls for cls in (Single, Rank, Shard, Consolidator)}
SINGLE = Single()


def join(*, shard: str | tuple[int, int] | None = None, consolidate_only: bool = False,
         device: str | None = None, environ: dict | None = None) -> World:
    """This process's World, joining the torchrun process group when the environment names one.

    Args:
        shard: "I/N" (or (I, N)): a plain process that encodes block I of N.
        consolidate_only: a process that only merges the parts the shards wrote.
        device: the device to encode on (None: cuda:LOCAL_RANK with CUDA, else cpu).
        environ: the environment to read (default os.environ).

    Returns:
        A `Single`, `Shard`, `Consolidator` or (under a launcher: RANK and WORLD_SIZE set) a `Rank`
        that joined the group: on `cuda:LOCAL_RANK` when CUDA is used, in a gloo process group
        (every collective is a small control message: barriers and the broadcast of the parts).
    """
    env = os.environ if environ is None else environ
    timeout_s = _timeout(env)
    launched = world_from_environment(env)
    if shard is not None and consolidate_only:
        raise ConfigError("--shard and --consolidate are two steps: run each shard with --shard I/N, "
                          "then one process with --consolidate")
    if (shard is not None or consolidate_only) and launched is not None and launched.size > 1:
        raise ConfigError(f"--shard/--consolidate are for plain processes, but this one is rank "
                          f"{launched.rank} of {launched.size} of a launch (RANK/WORLD_SIZE are set): "
                          f"under torchrun the ranks split the parts themselves; drop the flag")
    if shard is not None:
        index, count = parse_shard(shard) if isinstance(shard, str) else shard
        return Shard(index, count, device=device, timeout_s=timeout_s)
    if consolidate_only:
        return Consolidator(device=device, timeout_s=timeout_s)
    if launched is None:
        return Single(device=device, timeout_s=timeout_s)
    return _join_group(launched, device, timeout_s)


def world_from_environment(environ: dict | None = None) -> Rank | None:
    """The rank this process is in a launch (RANK, WORLD_SIZE, LOCAL_RANK...), or None outside one.

    No process group is joined here. ConfigError when the variables are inconsistent.
    """
    env = os.environ if environ is None else environ
    if env.get("RANK") is None and env.get("WORLD_SIZE") is None:
        return None
    values = {}
    for key, default in (("RANK", None), ("WORLD_SIZE", None), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        text = env.get(key, default)
        if text is None or not str(text).isdigit():
            raise ConfigError(f"{key}={text!r} in the environment: a launch sets RANK, WORLD_SIZE, LOCAL_RANK "
                              f"(and MASTER_ADDR, MASTER_PORT) to whole numbers; start the ranks with torchrun")
        values[key] = int(text)
    rank, size = values["RANK"], values["WORLD_SIZE"]
    if size < 1 or rank >= size or values["LOCAL_RANK"] > rank:
        raise ConfigError(f"RANK={rank}, WORLD_SIZE={size}, LOCAL_RANK={values['LOCAL_RANK']}: a rank is "
                          f"0..WORLD_SIZE-1 and LOCAL_RANK <= RANK; start the ranks with torchrun")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if size > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={size} but {' and '.join(missing)} not set: the ranks cannot meet; "
                          f"start them with torchrun, or set MASTER_ADDR/MASTER_PORT to rank 0's host and a free port")
    local_size = max(values["LOCAL_WORLD_SIZE"], values["LOCAL_RANK"] + 1)
    return Rank(rank, size, local_rank=values["LOCAL_RANK"], local_size=local_size, launch_name=launch_id(env))


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N; ConfigError otherwise (also an argparse type)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ConfigError(f"--shard {text!r}: write I/N with 0 <= I < N, e.g. --shard 0/2 and --shard 1/2 "
                          f"for two machines")
    return int(match[1]), int(match[2])


# ------------------------------------------------------------------------------ helpers


def _durable_bar(run_dir: str | Path, n_parts: int, label: str) -> DurableProgress:
    return DurableProgress(parts_dir(run_dir), [part_name(k) for k in range(n_parts)], desc=f"encode ({label})")


def _join_group(world: Rank, device: str | None, timeout_s: float) -> Rank:
    """Join the launch's process group (gloo) on cuda:LOCAL_RANK or the CPU.

    gloo, not nccl, on GPUs too: every collective here is a control message (barriers, the
    broadcast of the parts to encode), which gloo carries; an nccl group (started without
    device_id, then never used: every call went through a second, gloo group) cost each GPU a
    communicator and its memory for nothing.
    """
    import torch
    import torch.distributed as dist

    name = _rank_device(device, world.local_rank, torch.cuda.is_available(), world.local_size)
    if name.startswith("cuda"):
        torch.cuda.set_device(torch.device(name))
    timeout = timedelta(seconds=timeout_s)
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        group = dist.group.WORLD
    except (RuntimeError, ValueError) as exc:
        first = fmt_exception(exc)
        raise PeerLost(f"rank {world.rank} of {world.size} could not meet the others at "
                       f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({first}); check "
                       f"that every node runs the same command and can reach rank 0's address, then rerun") from exc
    return Rank(world.rank, world.size, name, timeout_s, local_rank=world.local_rank,
                local_size=world.local_size, launch_name=world.launch_name, group=group)


def _rank_device(device: str | None, local_rank: int, cuda_available: bool, local_size: int = 1) -> str:
    """cuda:LOCAL_RANK for None (with CUDA) or 'cuda'; the device named otherwise.

    A numbered GPU (`--device cuda:0`) with several ranks on the host would put them all on that
    GPU: refused, with the fix. With one rank per host it is that rank's GPU.
    """
    if device in (None, "cuda"):
        return f"cuda:{local_rank}" if (device == "cuda" or cuda_available) else "cpu"
    if device.startswith("cuda:") and local_size > 1:
        raise ConfigError(f"--device {device} with {local_size} ranks on this host puts every rank on one GPU; "
                          f"pass --device cuda (rank r takes cuda:LOCAL_RANK) or leave --device out")
    return device


def _timeout(env) -> float:
    text = env.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: give the seconds a rank waits for the others, e.g. 1800")
    return value


