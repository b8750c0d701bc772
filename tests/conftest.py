"""Shared test setup: every test runs against a private workspace, never the user's outputs/."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from nblib import encode, train  # noqa: F401  the jobs hand themselves to the trace layer, as cli, lab and widgets do

REPO = Path(__file__).resolve().parents[1]

# One per-user folder (trace cache, kept --model budgets, the compiled shim and pickle scanner) per test run, shared by
# its xdist workers and the notebooks' kernels: what an earlier run or the user kept never answers for a test that
# expects a trace, and a fresh clone's run is every run.
os.environ["XDG_CACHE_HOME"] = str(Path(tempfile.gettempdir()) / "nblib-test-runs"
                                   / (os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"))


@pytest.fixture(autouse=True)
def _private_workspace(tmp_path, monkeypatch):
    """Point the Drive fallback and the outputs folder at a fresh temporary folder."""
    monkeypatch.setenv("NBLIB_DRIVE_DIR", str(tmp_path / "drive"))
    monkeypatch.setenv("NBLIB_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.delenv("NBLIB_PROFILE", raising=False)
    yield


@pytest.fixture
def repo() -> Path:
    return REPO


def pytest_generate_tests(metafunc):
    """A test marked `two_doors` runs once through each door of tests/cli_runner.run_cli (its `door` argument)."""
    if metafunc.definition.get_closest_marker("two_doors") and "door" in metafunc.fixturenames:
        from cli_runner import DOORS

        metafunc.parametrize("door", DOORS)


def free_between_cases() -> None:
    """What a finished case left unreferenced goes now: reference cycles collected (a model in one is freed), then
    CUDA's cached blocks given back, so a gpu case never fails for memory a previous case still held.
    """
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_cases_start_clean(request):
    """Around every `gpu`-marked case where a GPU is: free_between_cases before and after it. Without one the case
    skips, and a full collection of a worker's heap after the traces cost 27 s of a fresh clone's `make test`.
    """
    torch = sys.modules.get("torch")
    gpu = request.node.get_closest_marker("gpu") is not None and torch is not None and torch.cuda.is_available()
    if gpu:
        free_between_cases()
    yield
    if gpu:
        free_between_cases()


def fresh_touched_bytes(nbytes: int):
    """`nbytes` of new anonymous pages, every page written: a real RSS rise in any process.

    np.ones can be served from memory the allocator already holds resident (a worker that ran
    other tests first), which adds no RSS; a fresh mmap cannot.
    """
    import mmap

    import numpy as np

    pages = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    pages[:] = 1
    return pages


@contextlib.contextmanager
def importable_models(folder: Path, resnet: dict, factory_source: str):
    """`folder` holding a tiny ResNet config (resnet.json) and a factory module (tinyfactory.py), on sys.path."""
    (folder / "resnet.json").write_text(json.dumps(resnet))
    (folder / "tinyfactory.py").write_text(textwrap.dedent(factory_source))
    sys.path.insert(0, str(folder))
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("tinyfactory", None)


@contextlib.contextmanager
def traceable_models(tmp_path_factory, factory_source: str):
    """`importable_models` of `factory_source` for a trace's backward pass: skips where the fake-CUDA shim
    cannot be built here (no compiler), with the reason.
    """
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    with importable_models(tmp_path_factory.mktemp("models"), {}, factory_source) as folder:
        yield folder


def hf_spec(path: Path, model_class: str, traced: bool = False, **sizes) -> str:
    """`hf:model_class:path` of a small transformers config (`sizes` over the class's defaults) written to `path`;
    traced: where this machine can trace a backward pass (the fake-CUDA shim builds), else skipped with the reason.
    """
    transformers = pytest.importorskip("transformers")
    if traced:
        from nblib.budget.shim import backward_capability

        ok, why = backward_capability()
        if not ok:
            pytest.skip(why)
    getattr(transformers, model_class).config_class(**sizes).to_json_file(path)
    return f"hf:{model_class}:{path}"


TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 200, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    """A 2-layer BertModel built from its config (hf:BertModel:config.json), random weights: a text encoder on ids."""
    return hf_spec(tmp_path_factory.mktemp("bert") / "bert.json", "BertModel", **TINY_BERT)


@pytest.fixture(scope="module")
def traced_bert(tmp_path_factory) -> str:
    """`tiny_bert` where this machine can trace it (the fake-CUDA shim builds); skipped with the reason elsewhere."""
    return hf_spec(tmp_path_factory.mktemp("bert") / "bert.json", "BertModel", traced=True, **TINY_BERT)


def shared_artifact(tmp_path_factory, name: str, build) -> Path:
    """A folder built once per test session, whichever xdist worker asks first: `build(folder)` under a file lock.

    For what tests only read (a cache, finished runs); a test that must change one copies it first. A build
    that raised leaves no mark, so the next caller builds it again (and fails the same way, in its own test).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                          # the session's folder, above every worker's own
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # a second worker waits here, then reads the first one's
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a real `python -m nblib ...` subprocess of this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def one_torch_thread():
    """Encode with one thread, as the CLI subprocesses do (OMP_NUM_THREADS=1): the same bytes everywhere."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cache(folder: Path, texts: list[str]) -> Path:
    """A real cache of `texts` at the smoke size (64 px) in 0.5 MB shards, so batches cross shard borders."""
    from nblib.cache import populate

    populate(texts, folder, image_size=64, shard_mb=0.5, workers=0, progress=False)
    return folder


def cache_folder_bytes(folder: Path) -> dict:
    """A cache folder's every file's bytes, manifest included; the local stat cache (this copy's stats) left out."""
    from nblib.cache import STAT_CACHE

    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAT_CACHE}
