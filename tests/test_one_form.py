"""One form for one kind of figure, and one answer for one question (newcomer 2026-12-01 P3, P17; issue 53).

P3: the headline gave one resource as a multiple ('drive 31.0x') and the next as a percentage. P17: counts
without thousands separators ('largest batch that fits: 10279'). And a job that nothing fits was told two Drive
sizes: the VERDICT's drive_quota_gb=517 (the run as configured) and the plan's drive_quota_gb=31 (its smallest
choice) for the same quota.
"""
from __future__ import annotations

import re

from nblib import budget, config

SEED = config.preset("seed_t4")


def test_every_resource_over_its_limit_reads_as_bytes_of_bytes_and_a_percentage():
    b = budget.predict_budget(SEED, "t4", drive_quota_gb=15)
    over = b.headline.split(": ", 1)[1]
    items = over.split(", ")
    assert len(items) == len(b.over) >= 2, b.headline                       # drive (31x its limit) and local disk
    for item in items:
        assert re.fullmatch(r"[a-z ]+ [\d,.]+ of [\d,.]+ GB \([\d,.]+%\)", item), item
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=3)
    assert not plan.fits and not re.search(r"\d\.\dx ", str(plan)) and "% of its limit" in str(plan)


def test_a_job_nothing_fits_is_told_one_drive_size():
    b = budget.predict_budget(SEED, "t4", drive_quota_gb=3)
    plan = budget.plan_budget(SEED, "t4", drive_quota_gb=3)
    said = set(re.findall(r"drive_quota_gb=(\d+)", b.verdict)) | set(re.findall(r"drive_quota_gb=(\d+)", str(plan)))
    assert len(said) == 1, (b.verdict, str(plan))
    assert "and the knobs above" in b.verdict                   # the size holds the run with its knobs at their most


def test_counts_the_budget_prints_carry_thousands_separators():
    from nblib.budget.model_vram import ModelVRAM

    fields = {f: None for f in ModelVRAM.__dataclass_fields__}
    vram = ModelVRAM(**{**fields, "spec": "m", "device": "t4", "precision": "fp16", "batch_size": 4096, "lines": (),
                        "limit": 15e9, "largest_batch": 10279, "train": False, "label": "traced",
                        "workspace_margin": 0, "reserved_by_position": {}})
    table = vram.table()
    assert "batch 4,096 " in table and "largest batch that fits: 10,279" in table, table
