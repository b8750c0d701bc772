"""Hand nbval the reference outputs of `# NBVAL_CHECK_OUTPUT` cells.

Notebooks are committed without outputs, so the references live in
`tests/nbval_references/<notebook>.json` (written by `scripts/nbtools.py refresh`, keyed by cell
id). nbval compares a checked cell only against a stored output that has an execution count;
this hook puts both on the collected cell before it runs.

It also runs the longest files first: `make test` hands whole files to its xdist workers
(--dist loadfile) in collection order (with --no-loadscope-reorder: xdist's default orders files by their
number of tests, so a long file of three tests, the browser's, started last and ran alone at the end while
the other workers idled).
"""
from __future__ import annotations

import json
from pathlib import Path

REFERENCES = Path(__file__).resolve().parent / "tests" / "nbval_references"
LONGEST_FIRST = (      # files by their test time, longest first: a --durations=0 profile of 2026-11-27 on 4 workers,
    # less each file's measured cut since (a long file started last runs alone while the other workers idle)
    "notebooks/05_input_pipeline_tuning.ipynb", "tests/test_hostile.py", "tests/test_train_resume.py",
    "tests/test_simulate.py", "notebooks/06_training.ipynb", "tests/test_gpu_report.py",
    "notebooks/02_cache_population.ipynb", "tests/test_distributed.py", "tests/test_encode_trace.py",
    "tests/test_model_vram.py", "tests/test_records.py", "notebooks/01_memory_budgeting.ipynb",
    "tests/test_hostile_round2.py", "tests/test_browser.py", "tests/test_colab.py", "tests/test_hostile_train.py",
    "tests/test_train_determinism.py", "tests/test_train_gcs.py", "notebooks/07_your_model.ipynb",
    "tests/test_measure.py", "notebooks/04_shuffle_buffer_checkpoints.ipynb", "tests/test_tfdata.py",
    "tests/test_budget.py", "tests/test_warm_traces.py", "tests/test_train_budget.py",
    "tests/test_trace_follows_gpu.py", "tests/test_training_vram_one_answer.py", "tests/test_cache_checks.py",
    "tests/test_encode_models.py", "tests/test_import_graph.py", "tests/test_save_makes_room.py",
    "tests/test_widgets.py", "notebooks/03_streaming_trm_encoding.ipynb", "tests/test_resume_io.py",
    "tests/test_train_models.py", "tests/test_encode.py",
)


def pytest_collection_modifyitems(items):
    _hand_nbval_its_references(items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    root = Path(__file__).resolve().parent
    place = {id(item): n for n, item in enumerate(items)}

    def key(item):
        try:
            name = Path(str(item.path)).resolve().relative_to(root).as_posix()
        except ValueError:
            name = ""
        return rank.get(name, len(rank)), place[id(item)]

    items.sort(key=key)


def _hand_nbval_its_references(items) -> None:
    import nbformat

    cache: dict[Path, dict] = {}
    for item in items:
        cell = getattr(item, "cell", None)
        if type(item).__name__ != "IPyNbCell" or cell is None or "id" not in cell:
            continue
        path = REFERENCES / f"{Path(str(item.parent.path)).stem}.json"
        if path not in cache:
            cache[path] = json.loads(path.read_text()) if path.exists() else {}
        reference = cache[path].get(cell.id)
        if reference and reference["outputs"]:
            cell.outputs = [nbformat.from_dict(o) for o in reference["outputs"]]
            cell.execution_count = 1
