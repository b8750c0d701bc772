"""One retention rule for a training run (issue 30): the store keeps what the budget, the bucket's cost, the
retention listing and the training panel size.

Notebook 06's budget sized the mirror for the last 3 states plus one best (6.90 MB) while retention kept three
best versions per side (8.32 MB listed) and the cost line assumed a third set of bytes. The rule now lives in
`nblib.budget.training.retained_versions` / `retained_bytes`; here a real training run with a mirror must leave
exactly that on each side, and the closed-form budget must size it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_train import FAST, labelled_cache

from nblib.budget.training import predict_training, retained_bytes, retained_versions
from nblib.lab.training import retention_listing, version_bytes
from nblib.store.checkpoints import CheckpointFolder, stem
from nblib.train import train
from nblib.train.loop import model_config
from nblib.train.ops import bucket_cost
from nblib.units import fmt_bytes

KEEP = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread: the same bytes as the CLI runs."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("retention")
    cache = labelled_cache(folder, 160)
    config = FAST.replace(steps=12, save_every=2, backup_every=2, eval_every=2, keep_last=KEEP)
    report = train(cache, folder / "run", config, mirror=str(folder / "mirror"), progress=False)
    return folder, config, report


def kept_files(root: Path) -> dict[str, list[int]]:
    folder = CheckpointFolder(root)
    return {name: folder.versions(name) for name in ("state", "best")}


def on_disk(root: Path) -> int:
    """Every file of the folder but the mirror's claim (mirror.json, the run's identity)."""
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file() and p.name != "mirror.json")


def test_a_real_run_leaves_the_rules_versions_and_bytes_on_each_side(run):
    folder, config, report = run
    improvements = [h["step"] for i, h in enumerate(report.history)
                    if h["heldout_loss"] < min(x["heldout_loss"] for x in report.history[:i] or [h]) or i == 0]
    assert len(improvements) >= 2, improvements          # older bests existed, so pruning them is tested
    states, bests = retained_versions(KEEP)
    for root in (folder / "run" / "checkpoints", folder / "mirror" / "checkpoints"):
        kept = kept_files(root)
        assert (len(kept["state"]), len(kept["best"])) == (states, bests), (root, kept)
        assert kept["best"] == [report.best_step]        # the one best kept is the best
        versions = {name: [sum((root / f"{stem(name, v)}{ext}").stat().st_size for ext in (".pt", ".json"))
                           for v in vs] for name, vs in kept.items()}
        assert on_disk(root) == sum(versions["state"]) + sum(versions["best"])     # nothing else is left
        newest = retained_bytes(version_bytes(root, "state"), version_bytes(root, "best"), KEEP)
        assert abs(newest - on_disk(root)) <= 64 * KEEP, (newest, on_disk(root))   # states differ by their history


def test_the_budget_the_cost_line_and_the_listing_size_what_retention_leaves(run):
    folder, config, report = run
    mirror = folder / "mirror" / "checkpoints"
    budget = predict_training(model_config(config.profile).model, config.batch_size, n_classes=len(report.classes),
                              keep_last=KEEP)
    assert budget.mirror == retained_bytes(budget.checkpoint_bytes, budget.best_bytes, KEEP)
    assert budget.local_disk == retained_bytes(budget.checkpoint_bytes, budget.best_bytes, KEEP, saving=True)
    assert abs(budget.mirror / on_disk(mirror) - 1) <= 0.02, (budget.mirror, on_disk(mirror))
    state, best = version_bytes(mirror, "state"), version_bytes(mirror, "best")
    cost = bucket_cost(state, best, steps=1000, backup_every=10, keep_last=KEEP)
    assert cost.stored_bytes == retained_bytes(state, best, KEEP)
    listing = retention_listing(folder / "run", folder / "mirror", KEEP)
    assert f"mirror  states at steps {kept_files(mirror)['state']}, best at steps [{report.best_step}]" in listing
    assert f"{fmt_bytes(on_disk(mirror))} on disk" in listing
    assert f"(last {KEEP} states + 1 best) with these files' sizes: {fmt_bytes(cost.stored_bytes)}" in listing
