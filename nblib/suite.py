"""Run the whole notebook suite headless, in order, and report a table (what `make run` does).

Each notebook is executed with nbclient in its own kernel (its cwd is notebooks/); the executed
copy goes to `outputs/notebooks/`, figures land where the notebooks save them
(`outputs/figures/`). A failing notebook does not stop the others; the exit status says.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from nblib import env


@dataclass(frozen=True)
class NotebookResult:
    """One executed notebook: its name, 'ok' or 'FAILED', seconds, and the error's last line."""

    name: str
    status: str
    seconds: float
    error: str = ""


def notebooks_in_order(folder: str | Path) -> list[Path]:
    """The numbered notebooks (NN_name.ipynb) of a folder, in their order."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def run_notebook(path: str | Path, out_dir: str | Path, timeout: int = 900) -> NotebookResult:
    """Execute one notebook; write the executed copy to out_dir even when a cell fails."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    status, error = "ok", ""
    try:
        client.execute()
    except CellExecutionError as exc:
        status = "FAILED"
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        error = lines[-1] if lines else type(exc).__name__
    except Exception as exc:  # a dead kernel or a timeout: report it, run the next notebook
        status, error = "FAILED", f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    nbformat.write(nb, out_dir / path.name)
    return NotebookResult(path.name, status, seconds, error)


def run_suite(notebooks_dir: str | Path | None = None, out_dir: str | Path | None = None,
              progress: bool = True) -> list[NotebookResult]:
    """Execute every numbered notebook in order; returns one result per notebook."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # kernels inherit these: no TF log noise
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    root = env.repo_root() or Path.cwd()
    notebooks_dir = Path(notebooks_dir or root / "notebooks")
    out_dir = Path(out_dir or env.outputs_dir() / "notebooks")
    results = []
    for path in notebooks_in_order(notebooks_dir):
        if progress:
            print(f"running {path.name} ...", flush=True)
        results.append(run_notebook(path, out_dir))
        if progress:
            r = results[-1]
            print(f"  {r.status} in {r.seconds:.0f} s {r.error}", flush=True)
    return results


def format_table(results: list[NotebookResult]) -> str:
    """A plain-text summary table: notebook, status, seconds."""
    width = max([len("notebook")] + [len(r.name) for r in results])
    lines = [f"{'notebook':<{width}}  {'status':<6}  {'seconds':>7}", "-" * (width + 17)]
    lines += [f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}" for r in results]
    total = sum(r.seconds for r in results)
    lines.append(f"{'total':<{width}}  {'':<6}  {total:7.1f}")
    return "\n".join(lines)
