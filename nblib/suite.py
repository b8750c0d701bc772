"""Run the whole notebook suite headless, in order, and report a table (what `make run` does).

Each notebook is executed with nbclient in its own kernel (its cwd is notebooks/); the executed
copy goes to `outputs/notebooks/`, figures land where the notebooks save them
(`outputs/figures/`). A failing notebook does not stop the others; the exit status says.

A watchdog fails a notebook that stops producing output: when no message comes from its kernel for
`inactivity_s` seconds (default `INACTIVITY_S`, or NBLIB_SUITE_INACTIVITY_S, or `--inactivity-s`),
whether inside a cell or while the kernel shuts down after the last one, the kernel's process group
is killed and the notebook is FAILED with a `NotebookStalled` naming the notebook, the cell and how
long it was silent, instead of waiting nbclient's per-cell timeout. Trade-off: a cell that computes
silently for longer than the limit is failed too; long cells show a progress bar (its updates count
as output), and the limit is a knob.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from nblib import env
from nblib.errors import ConfigError, NotebookStalled
from nblib.units import fmt_duration

INACTIVITY_S = 300.0    # seconds without any message from the kernel before a notebook is failed
# The kernels' threads as `make test` sets them (a variable the user set is kept): several torch threads per core
# on a busy machine ran notebook 03 14x slower (375 s, 26 s with one).
KERNEL_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


@dataclass(frozen=True)
class NotebookResult:
    """One executed notebook: its name, 'ok' or 'FAILED', seconds, and the error's last line."""

    name: str
    status: str
    seconds: float
    error: str = ""


def inactivity_limit(seconds: float | None = None) -> float:
    """The runner's inactivity limit: `seconds`, else NBLIB_SUITE_INACTIVITY_S, else INACTIVITY_S."""
    raw = seconds if seconds is not None else os.environ.get("NBLIB_SUITE_INACTIVITY_S", INACTIVITY_S)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"inactivity limit {raw!r} is not a positive number of seconds; set "
                          f"NBLIB_SUITE_INACTIVITY_S (or --inactivity-s) to e.g. {INACTIVITY_S:.0f}")
    return value


def run_notebook(path: str | Path, out_dir: str | Path, timeout: int = 900,
                 inactivity_s: float | None = None) -> NotebookResult:
    """Execute one notebook; write the executed copy to out_dir even when a cell fails or it stalls."""
    import nbformat
    from jupyter_core.utils import run_sync
    from nbclient.exceptions import CellExecutionError

    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    client = _watched_client(nb, path, timeout, inactivity_limit(inactivity_s))
    start = time.perf_counter()
    status, error = "ok", ""
    try:
        run_sync(client.async_execute)(env=kernel_environment())
    except CellExecutionError as exc:
        status = "FAILED"
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        error = lines[-1] if lines else type(exc).__name__
    except Exception as exc:  # a stall, a dead kernel or a timeout: report it, run the next notebook
        status, error = "FAILED", f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    nbformat.write(nb, out_dir / path.name)
    return NotebookResult(path.name, status, seconds, error)


def kernel_environment() -> dict[str, str]:
    """The environment a notebook's kernel starts with: this process's, with `KERNEL_THREADS` where unset."""
    return {**KERNEL_THREADS, **os.environ}


def run_suite(notebooks_dir: str | Path | None = None, out_dir: str | Path | None = None,
              progress: bool = True, inactivity_s: float | None = None) -> list[NotebookResult]:
    """Execute every numbered notebook in order; returns one result per notebook."""
    limit = inactivity_limit(inactivity_s)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # kernels inherit these: no TF log noise
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    root = env.repo_root() or Path.cwd()
    notebooks_dir = Path(notebooks_dir or root / "notebooks")
    out_dir = Path(out_dir or env.outputs_dir() / "notebooks")
    results = []
    for path in sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb")):     # the numbered notebooks, in their order
        if progress:
            print(f"running {path.name} ...", flush=True)
        results.append(run_notebook(path, out_dir, inactivity_s=limit))
        if progress:
            r = results[-1]
            print(f"  {r.status} in {fmt_duration(r.seconds)} {r.error}", flush=True)
    return results


def format_table(results: list[NotebookResult]) -> str:
    """A plain-text summary table: notebook, status, seconds."""
    width = max([len("notebook")] + [len(r.name) for r in results])
    lines = [f"{'notebook':<{width}}  {'status':<6}  {'seconds':>7}", "-" * (width + 17)]
    lines += [f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}" for r in results]
    total = sum(r.seconds for r in results)
    lines.append(f"{'total':<{width}}  {'':<6}  {total:7.1f}")
    return "\n".join(lines)


class _Watch:
    """When the kernel last spoke, and where the notebook was then (the cell, or the kernel's shutdown)."""

    def __init__(self, name: str, limit_s: float):
        self.name, self.limit_s = name, limit_s
        self.last: float | None = None        # armed by the first cell: the kernel's start has its own timeout
        self.where = ""

    def touch(self) -> None:
        self.last = time.monotonic()

    def begin(self, where: str) -> None:
        self.where = where
        self.touch()

    def silent_s(self) -> float:
        return 0.0 if self.last is None else time.monotonic() - self.last

    def error(self) -> NotebookStalled:
        return NotebookStalled(
            f"{self.name} produced no output for {fmt_duration(self.silent_s())} {self.where}; its kernel was killed. "
            f"Look for what that cell leaves waiting (a thread, a worker process, a server); if the cell is "
            f"only slow, raise NBLIB_SUITE_INACTIVITY_S (now {self.limit_s:g} s) or give it a progress bar")


def _cell_label(cell, index: int) -> str:
    """'in cell 12 (`report = train(...`)': the cell's index and its first line of code."""
    lines = [ln.strip() for ln in cell.source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    first = lines[0] if lines else ""
    return f"in cell {index} (`{first[:60]}`)"


def _watched_client(nb, path: Path, timeout: int, limit_s: float):
    """An nbclient NotebookClient whose run fails with NotebookStalled after `limit_s` s without a message."""
    from nbclient import NotebookClient

    class WatchedClient(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            if cell.cell_type == "code" and cell.source.strip():
                watch.begin(_cell_label(cell, cell_index))
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)

        def process_message(self, msg, cell, cell_index):
            watch.touch()                 # any output, status or widget message of the running cell
            return super().process_message(msg, cell, cell_index)

        async def _async_cleanup_kernel(self):
            if self.km is not None and watch.last is not None:
                watch.begin(f"after its last cell ran, while its kernel shut down ({watch.where} was the last)")
            return await super()._async_cleanup_kernel()

        async def async_execute(self, reset_kc: bool = False, **kwargs):
            work = asyncio.ensure_future(super().async_execute(reset_kc=reset_kc, **kwargs))
            while not work.done():
                await asyncio.wait({work}, timeout=min(1.0, limit_s / 4))
                if not work.done() and watch.silent_s() > limit_s:
                    stalled = watch.error()
                    _kill_kernel(self.km)        # nbclient sees a dead kernel and cleans up as after a crash
                    await asyncio.wait({work}, timeout=60)
                    if not work.done():
                        work.cancel()
                        await asyncio.wait({work}, timeout=10)
                    if work.done() and not work.cancelled():
                        work.exception()         # retrieved: the stall is the error reported
                    raise stalled
            return work.result()

    watch = _Watch(path.name, limit_s)
    return WatchedClient(nb, timeout=timeout, kernel_name="python3",
                         resources={"metadata": {"path": str(path.parent)}})


def _kill_kernel(km) -> None:
    """SIGKILL the kernel's process group (the kernel and what it started): a stalled kernel gets no grace."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None:
        return
    with contextlib.suppress(OSError):
        group = os.getpgid(process.pid)
        if group != os.getpgid(0):        # the kernel's own session (jupyter_client starts one), never ours
            os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(OSError):
        process.kill()
