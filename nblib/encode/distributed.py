"""Scaling encode out over processes: who this one is, which parts it encodes, and meeting the others.

A `World` says what this process is in a run: the only one ("single"), a rank of a `torchrun`
launch ("rank": RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR in the environment; gloo on CPU,
nccl on `cuda:LOCAL_RANK`), one of N plain processes sharing only a folder ("shard", `--shard
I/N`), or the one that merges their parts ("consolidate"). Parts are fixed sample ranges, so the
split is by part and deterministic: a launch's ranks split the parts not yet durable (rank 0's
list, broadcast), shard I takes block I of all the parts. No two processes write one file: each
part is written by the process it was given to, ranks never write the run manifest (the
consolidating process rebuilds it from the verified parts), and each process records what it
was given and wrote in its own file under `ranks/`. A barrier with a timeout stops every rank
with a message when one dies, never a hang. Trade-off: parts are split in contiguous blocks,
which keeps each rank's reads sequential in the cache but lets the last rank finish a part
later than the others. torch is imported only when a process group is joined.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nblib.config import PipelineConfig
from nblib.errors import BudgetExceeded, ConfigError, ManifestDamaged, NblibError, StateError
from nblib.manifest import read_manifest, write_manifest
from nblib.units import GB, fmt_bytes, fmt_duration, fmt_exception

ROLES = ("single", "rank", "shard", "consolidate")
RANKS_FOLDER = "ranks"             # under the run folder: one record per process that encoded parts
RECORD_KIND = "nblib.encode.rank"
RECORD_VERSION = 1
TIMEOUT_ENV = "NBLIB_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0         # how long a rank waits at a barrier for the others
PROGRESS_POLL_S = 2.0              # rank 0's bar re-counts the durable parts this often
_PART_FILE = "part.json"


class PeerLost(NblibError):
    """A rank of the launch died or stalled: the others stop instead of waiting for ever."""


@dataclass(frozen=True)
class World:
    """This process's place in a run: its role, rank and world size, and how it meets the others."""

    role: str = "single"
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    launch: str | None = None          # shared by the processes of one launch (the lock's identity)
    device: str | None = None          # the device this rank encodes on (None: encode picks)
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: Any = field(default=None, compare=False, repr=False)  # the gloo group of a torchrun launch

    @property
    def distributed(self) -> bool:
        """True unless this is a plain single-process run (which writes its manifest as it goes)."""
        return self.role != "single"

    @property
    def consolidates(self) -> bool:
        """True for the one process that merges the parts: single, rank 0 of a launch, --consolidate."""
        return self.role in ("single", "consolidate") or (self.role == "rank" and self.rank == 0)

    @property
    def label(self) -> str:
        return {"single": "single process", "consolidate": "consolidation"}.get(
            self.role, f"{self.role} {self.rank}/{self.size}")

    @property
    def lock_environ(self) -> dict | None:
        """The environment the run lock's identity is read from: the shards of N share one launch."""
        return {"TORCHELASTIC_RUN_ID": self.launch} if self.role == "shard" else None

    def assign(self, pending: list[int], n_parts: int, store=None, fingerprints: dict | None = None) -> list[int]:
        """This process's share of the parts not yet durable (`pending`), recorded in its `store`.

        Ranks take block `rank` of rank 0's pending list (after a barrier, so nobody writes while
        another lists); shard I takes the pending parts of block I of all parts; --consolidate
        encodes none.
        """
        if self.role == "single":
            return list(pending)
        if self.role == "consolidate":
            return []
        if self.role == "shard":
            left = set(pending)
            mine = [k for k in split(range(n_parts), self.rank, self.size) if k in left]
        else:
            pending = self._agree(pending, n_parts, fingerprints)
            mine = split(pending, self.rank, self.size)
        if isinstance(store, RankStore):
            store.begin(self, mine)
        return mine

    def barrier(self, what: str) -> None:
        """Wait until every rank of the launch is here; PeerLost when one does not come in time."""
        if self.role != "rank" or self.size == 1:
            return
        from datetime import timedelta

        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as exc:     # DistBackendError, gloo timeouts and closed connections
            raise self._lost(what, exc) from exc

    def part_store(self, store, run_dir: str | Path, n_parts: int):
        """The store this process writes its parts through: `store` itself in a single run.

        Otherwise a `RankStore` that never writes the shared run manifest and records each part
        written (under run_dir/ranks).
        """
        if self.role == "single":
            return store
        block = split(range(n_parts), self.rank, self.size) if self.role == "shard" else range(n_parts)
        return RankStore(store, Path(run_dir), watched={_part_name(k) for k in block})

    def refuse_mirror(self) -> None:
        """ConfigError unless single: each rank's mirror thread would copy the other ranks' parts too."""
        if self.role != "single":
            raise ConfigError(
                f"--mirror is for one process; with several ({self.label}) write --out on the folder "
                f"every process shares (the Drive or network folder itself) and leave --mirror out")

    def progress(self, run_dir: str | Path, n_parts: int, enabled: bool = True):
        """Rank 0's (and each shard's) bar over the whole run's durable parts; nothing elsewhere."""
        shows = self.role == "shard" or (self.role == "rank" and self.rank == 0)
        if not (enabled and shows):
            return contextlib.nullcontext()
        from nblib.encode.run import PARTS_FOLDER

        names = [_part_name(k) for k in range(n_parts)]
        return DurableProgress(Path(run_dir) / PARTS_FOLDER, names, desc=f"encode ({self.label})")

    def preflight(self, config: PipelineConfig, device: str | None = None) -> None:
        """The host's RAM for all of its ranks (local rank 0 checks); the rest is per rank already."""
        if self.role == "rank" and self.local_rank == 0 and self.local_size > 1:
            check_host_ram(config, self.local_size, device)

    def close(self) -> None:
        """Leave the process group (a torchrun rank); nothing for the other roles."""
        if self.role == "rank":
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
            f"raise {TIMEOUT_ENV} (now {self.timeout_s:.0f} s)")


SINGLE = World()


def join(*, shard: str | tuple[int, int] | None = None, consolidate_only: bool = False,
         device: str | None = None, environ: dict | None = None) -> World:
    """This process's World, joining the torchrun process group when the environment names one.

    `shard` ("I/N") makes a plain process encode block I of N; `consolidate_only` one that only
    merges. Under a launcher (RANK and WORLD_SIZE set) the group is joined: nccl on
    `cuda:LOCAL_RANK` when CUDA is used, gloo on CPU, plus a gloo group for barriers either way.
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
        return World("shard", index, count, launch=f"nblib-shards-of-{count}", device=device,
                     timeout_s=timeout_s)
    if consolidate_only:
        return World("consolidate", device=device, timeout_s=timeout_s)
    if launched is None:
        return World(device=device, timeout_s=timeout_s)
    return _join_group(launched, device, timeout_s)


def world_from_environment(environ: dict | None = None) -> World | None:
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
    from nblib.lock import launch_id

    local_size = max(values["LOCAL_WORLD_SIZE"], values["LOCAL_RANK"] + 1)
    return World("rank", rank, size, values["LOCAL_RANK"], local_size, launch=launch_id(env))


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N; ConfigError otherwise (also an argparse type)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ConfigError(f"--shard {text!r}: write I/N with 0 <= I < N, e.g. --shard 0/2 and --shard 1/2 "
                          f"for two machines")
    return int(match[1]), int(match[2])


def split(items: Sequence, index: int, count: int) -> list:
    """Block `index` of `count` near-equal contiguous blocks of `items` (the first ones one longer)."""
    items = list(items)
    size, extra = divmod(len(items), count)
    start = index * size + min(index, extra)
    return items[start:start + size + (index < extra)]


def part_writes(run_dir: str | Path) -> dict[str, int]:
    """How many times each part was written, over every process's record (a count of 2: done twice)."""
    counts: dict[str, int] = {}
    for record in read_records(run_dir):
        for name in record["written"]:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def read_records(run_dir: str | Path) -> list[dict]:
    """Every process's record under run_dir/ranks (what it was given, wrote, when), oldest first."""
    records = []
    for path in sorted((Path(run_dir) / RANKS_FOLDER).glob("*.json")):
        try:
            record = read_manifest(path, RECORD_KIND, versions=(RECORD_VERSION,))
        except ManifestDamaged as exc:
            warnings.warn(f"{exc}; that record is skipped", stacklevel=2)
            continue
        if record is not None:
            records.append(record.body)
    return sorted(records, key=lambda r: r["started"])


def require_all_parts(run_dir: str | Path, durable: Sequence[str], n_parts: int) -> None:
    """StateError naming the parts not yet durable and the shards (or ranks) that were to write them."""
    durable = set(durable)
    missing = [k for k in range(n_parts) if _part_name(k) not in durable]
    if not missing:
        return
    lines = [f"run {run_dir} is not complete: {len(missing)} of {n_parts} parts are not durable yet "
             f"({_name_ranges(missing)})"]
    lines += _who_owes(read_records(run_dir), missing, n_parts)
    lines.append("run the missing shards with the same arguments (python -m nblib encode ... --shard I/N) "
                 "or rerun the launch, then --consolidate again; the durable parts are kept")
    raise StateError("; ".join(lines))


# ------------------------------------------------------------------------------ the rank's store


class RankStore:
    """A process's view of the shared store: parts go through, the run manifest does not.

    Ranks never write the run manifest (the consolidating process rebuilds it from the verified
    parts), and each part written is added to this process's record under run_dir/ranks.
    """

    def __init__(self, inner, run_dir: Path, watched: set[str]):
        self.inner = inner
        self.run_dir = run_dir
        self.local_dir = inner.local_dir
        self._watched = watched      # parts whose damage is reported (another shard's are in flight)
        self._record: dict | None = None
        self._path: Path | None = None
        self._seq = 0

    @property
    def local(self):
        return self.inner.local

    @property
    def mirror_lag(self) -> int:
        return self.inner.mirror_lag

    def begin(self, world: World, assigned: list[int]) -> None:
        """Start this process's record: its role, rank, host, pid and the parts it was given."""
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]
        name = f"{world.role}-{world.rank}-of-{world.size}.{host}.{os.getpid()}.json"
        self._path = self.run_dir / RANKS_FOLDER / name
        self._record = {"role": world.role, "rank": world.rank, "size": world.size, "launch": world.launch,
                        "host": socket.gethostname(), "pid": os.getpid(),
                        "assigned": [_part_name(k) for k in assigned], "written": [],
                        "started": time.time(), "updated": time.time()}
        self._save()

    def write_part(self, name: str, arrays: dict[str, np.ndarray], meta: dict | None = None):
        info = self.inner.write_part(name, arrays, meta)
        if self._record is not None:
            self._record["written"].append(name)
            self._record["updated"] = time.time()
            self._save()
        return info

    def list_parts(self, verify: bool | str = True) -> list:
        """The verified parts; damaged copies are named unless another shard is writing them now."""
        parts, damaged = self.inner.local.list(verify)
        mine = [d for d in damaged if d.name in self._watched]
        if mine:
            listed = "; ".join(f"{d.name} ({d.reason})" for d in mine[:5])
            warnings.warn(f"{len(mine)} damaged parts are ignored (encoded again by the process given them): "
                          f"{listed}", stacklevel=3)
        return parts

    def read_part(self, name: str, mmap: bool = True, verify: bool | str = True) -> dict[str, np.ndarray]:
        return self.inner.read_part(name, mmap=mmap, verify=verify)

    def write_manifest(self, obj: dict) -> None:
        """Nothing: several processes write parts, so none writes the shared run manifest meanwhile."""

    def read_manifest(self, local_only: bool = False) -> dict | None:
        return self.inner.read_manifest(local_only=local_only)

    def mirror_status(self):
        return self.inner.mirror_status()

    def verify(self) -> tuple[list, list]:
        """Every part hashed (the consolidating process calls it after the last barrier)."""
        return self.inner.verify()

    def delete_part(self, name: str) -> None:
        self.inner.delete_part(name)

    def flush(self, timeout: float | None = None) -> bool:
        return self.inner.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        return self.inner.close(timeout)

    def _save(self) -> None:
        write_manifest(self._path, RECORD_KIND, self._record, version=RECORD_VERSION, seq=self._seq)
        self._seq += 1


# ------------------------------------------------------------------------------ progress


class DurableProgress:
    """One bar for the whole run: parts whose part.json is there, re-counted every few seconds."""

    def __init__(self, parts_dir: Path, names: list[str], desc: str = "encode", poll_s: float = PROGRESS_POLL_S):
        self.parts_dir, self.names, self.desc, self.poll_s = parts_dir, names, desc, poll_s
        self.done: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bar = None

    def count(self) -> int:
        """Parts durable now (those seen once stay counted: only the others are looked at)."""
        for name in self.names:
            if name not in self.done and (self.parts_dir / name / _PART_FILE).is_file():
                self.done.add(name)
        return len(self.done)

    def __enter__(self) -> DurableProgress:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(self.names), initial=self.count(), unit="part", desc=self.desc)
        self._thread = threading.Thread(target=self._poll, name="nblib-durable-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()
        self.bar.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._update()

    def _update(self) -> None:
        self.bar.update(self.count() - self.bar.n)


# ------------------------------------------------------------------------------ budget per rank


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
    def fits(self) -> bool:
        dev, limits = self.single.device, self.single.limits
        return (self.vram_per_rank <= limits["vram"] or not dev.is_gpu) and self.host_ram <= limits["ram"] \
            and self.drive_total <= limits["drive"]

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
            f"  time              {fmt_duration(self.seconds)} = {fmt_duration(self.single.seconds)} / "
            f"{self.world_size} ranks (projection: perfect scaling)",
            f"  verdict           {'fits' if self.fits else 'does NOT fit'}"])


def rank_budget(config: PipelineConfig, device: str = "t4", world_size: int = 1, *,
                ranks_per_host: int | None = None, **predict_kwargs) -> RankBudget:
    """The budget of an encode run over `world_size` ranks (`ranks_per_host` of them per machine).

    Computed from `nblib.budget.predict_budget` of the whole run: each rank holds the same model,
    batches and part buffers as one process, the shared folder holds every part once, and the
    time is divided by the ranks.
    """
    from nblib import budget

    budget.require_positive("world_size", world_size)
    per_host = world_size if ranks_per_host is None else ranks_per_host
    budget.require_positive("ranks_per_host", per_host)
    single = budget.predict_budget(config, device, **predict_kwargs)
    r = single.config.run
    part = min(r.checkpoint_every * r.batch_size, r.n_samples) * budget.output_bytes_per_image(single.config)
    return RankBudget(single, world_size, min(per_host, world_size), part)


def check_host_ram(config: PipelineConfig, ranks_per_host: int, device: str | None = None) -> None:
    """BudgetExceeded when the ranks of this host together need more RAM than is available."""
    import psutil

    from nblib.budget import KNOBS, RUNTIME_RAM_CPU, RUNTIME_RAM_CUDA

    cuda = device is not None and str(device).startswith("cuda")
    plan = rank_budget(config, "t4" if cuda else "cpu", ranks_per_host, ranks_per_host=ranks_per_host)
    runtime = RUNTIME_RAM_CUDA if cuda else RUNTIME_RAM_CPU
    need = (plan.ram_per_rank - runtime) * ranks_per_host      # each rank already holds its runtime
    available = psutil.virtual_memory().available
    if need > available:
        raise BudgetExceeded(
            f"{ranks_per_host} ranks on this host need {need / GB:.2f} GB more RAM "
            f"({(plan.ram_per_rank - runtime) / GB:.2f} GB each) but {available / GB:.2f} GB is available; "
            f"start fewer ranks per host (--nproc_per_node) or {KNOBS['ram']}")


# ------------------------------------------------------------------------------ helpers


def _join_group(world: World, device: str | None, timeout_s: float) -> World:
    """Join the launch's process group: nccl on cuda:LOCAL_RANK, gloo on CPU; a gloo group for barriers."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    name = _rank_device(device, world.local_rank, torch.cuda.is_available())
    cuda = name.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(name))
    timeout = timedelta(seconds=timeout_s)
    try:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        group = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    except (RuntimeError, ValueError) as exc:
        first = fmt_exception(exc)
        raise PeerLost(f"rank {world.rank} of {world.size} could not meet the others at "
                       f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({first}); check "
                       f"that every node runs the same command and can reach rank 0's address, then rerun") from exc
    return World("rank", world.rank, world.size, world.local_rank, world.local_size, world.launch,
                 name, timeout_s, group)


def _rank_device(device: str | None, local_rank: int, cuda_available: bool) -> str:
    """cuda:LOCAL_RANK for None (with CUDA) or 'cuda'; the device named otherwise."""
    if device in (None, "cuda"):
        return f"cuda:{local_rank}" if (device == "cuda" or cuda_available) else "cpu"
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


def _part_name(k: int) -> str:
    from nblib.encode.run import RunPlan

    return RunPlan.part_name(k)


def _name_ranges(indices: list[int]) -> str:
    """part-000002..part-000005, part-000009: runs of consecutive parts, the first 8 runs."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = [_part_name(a) if a == b else f"{_part_name(a)}..{_part_name(b)}" for a, b in runs[:8]]
    return ", ".join(text) + (f" and {len(runs) - 8} more runs" if len(runs) > 8 else "")


def _who_owes(records: list[dict], missing: list[int], n_parts: int) -> list[str]:
    """One line per shard (or launch) whose parts are missing: never ran, or ran and stopped."""
    shard_counts = sorted({r["size"] for r in records if r["role"] == "shard"})
    if not shard_counts and not records:
        return ["no shard or rank has recorded work in this folder yet"]
    lines = []
    for count in shard_counts or []:
        for index in range(count):
            owed = [k for k in split(range(n_parts), index, count) if k in set(missing)]
            if not owed:
                continue
            ran = [r for r in records if (r["role"], r["rank"], r["size"]) == ("shard", index, count)]
            if not ran:
                status = "never ran here"
            else:
                last = ran[-1]
                where = f"ran on {last['host']} (pid {last['pid']}) and wrote"
                status = (f"{where} all {len(last['assigned'])} of its parts, but these are missing or damaged now"
                          if set(last["written"]) >= set(last["assigned"]) else
                          f"{where} {len(last['written'])} of its {len(last['assigned'])} parts, then stopped "
                          f"or is still running")
            lines.append(f"shard {index}/{count} owes {_name_ranges(owed)}: {status}")
    if not shard_counts:
        launches = sorted({(r["size"], r["launch"]) for r in records}, key=str)
        lines.append(f"they were left by {len(launches)} torchrun launch(es) of "
                     f"{', '.join(str(s) for s, _ in launches)} ranks")
    return lines
