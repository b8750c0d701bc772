"""One rule for "fits" (`nblib.budget.resources.fits`: a need fits within 90% of its limit) on every surface.

Issue 37: seed_t4 at batch 230 with a 2 TB Drive was "fits ... ram binds at 10.12 of 11.00 GB (92%)" in the
headline while max_batch_size said 215, and the preflight's checks refused only past 100%. Each test asks
every surface the same question on the same config and compares the answers; free disk, RAM and VRAM are
fixed (monkeypatched) so the numbers do not depend on this machine.
"""
from __future__ import annotations

import collections
import math
import re
import sys

import pytest
from cli_runner import run_nblib
from shard_budget import shard_size_for_ram

import nblib
from nblib import budget, config
from nblib.budget import resources
from nblib.budget.memory import LOADER_WORKER_RAM, RUNTIME_RAM_CPU, host_memory_lines

SEED = config.preset("seed_t4")
GB = 1e9
PREFLIGHT = sys.modules["nblib.budget.preflight"]
QUOTA = 2000            # a 2 TB Drive, and 300,000 samples (the run folder's parts and outputs fit 78 GB):
N = 300_000             # only RAM binds for seed_t4 on a T4


def cli_budget(batch: int) -> tuple[str, int]:
    """(the VERDICT line, the max batch size) that `python -m nblib budget` prints, run in-process."""
    done = run_nblib("budget", "--batch-size", batch, "--n-samples", N, "--drive-quota-gb", QUOTA)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    verdict = next(line for line in text.splitlines() if line.startswith("VERDICT"))
    largest = re.search(r"max batch size on t4: ([\d,]+)", text).group(1)          # '215', '1,415'
    return verdict.removeprefix("VERDICT").strip(), int(largest.replace(",", ""))


@pytest.fixture(scope="module")
def largest() -> int:
    return budget.max_batch_size(SEED.replace(n_samples=N), "t4", drive_quota_gb=QUOTA)


@pytest.mark.parametrize("above", [0, 1, 15])        # the largest batch, one more, and the issue's 230
def test_every_surface_gives_one_answer_to_fits_and_to_the_largest_batch(largest, above):
    batch = largest + above
    b = budget.predict_budget(SEED.replace(batch_size=batch, n_samples=N), "t4", drive_quota_gb=QUOTA)
    rule = all(resources.fits(b.totals[r], b.limits[r]) for r in resources.RESOURCES if b.limits[r])
    assert rule == (above == 0)                         # the rule: 90% of each limit
    issue = budget.predict_budget(SEED.replace(batch_size=230), "t4", drive_quota_gb=QUOTA)     # the issue's case
    assert not issue.fits and issue.headline.startswith("does NOT fit") and "ram 10.12 of 11.00 GB" in issue.headline
    assert b.fits == rule and b.headline.startswith("fits on t4" if rule else "does NOT fit on t4"), b.headline
    assert "10% margin" in b.headline and "the target is 90%" in b.headline, b.headline
    verdict, cli_largest = cli_budget(batch)
    assert verdict == b.verdict and cli_largest == largest
    if rule:
        assert not b.advice
        return
    ram = next(a for a in b.advice if a.resource == "ram")          # the advice's batch is max_batch_size's
    assert {s.knob: s.value for s in ram.suggestions}["run.batch_size"] == largest, ram
    assert f"> {resources.room(b.limits['ram']) / GB:.2f} GB (90% of 11.00 GB)" in ram.text, ram.text
    plan = budget.plan_budget(SEED.replace(batch_size=batch, n_samples=N), "t4", drive_quota_gb=QUOTA)   # a knob
    assert plan.fits and plan.budget.fits and plan.changes and plan.budget.headline.startswith("fits on t4")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A workspace on one disk with `free["disk"]` bytes free and `free["ram"]` bytes of RAM available."""
    import psutil

    free = {"disk": 2000 * GB, "ram": 100 * GB}
    memory = collections.namedtuple("memory", "available")
    for where in ("nblib.disk.disk_free", "nblib.encode.disks.disk_free"):
        monkeypatch.setattr(where, lambda folder: free["disk"])
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(free["ram"]))
    return nblib.env.workspace(tmp_path / "drive"), free


def refusal(cfg, workspace, **kwargs) -> str:
    with pytest.raises(nblib.BudgetExceeded) as info:
        budget.preflight(cfg, workspace, **kwargs)
    return str(info.value)


def short_and_more(message: str, need: float, limit: float) -> None:
    """The refusal states the margin, and its "GB short" is need / 0.9 - limit, as any "GB more" it offers."""
    short = resources.fmt_size(math.ceil(resources.shortfall(need, limit)))   # '0.36 GB'; '59.69 MB' under 0.1 GB
    assert f"with a 10% margin it may fill {resources.room(limit) / GB:,.2f} GB of {limit / GB:,.2f} GB" in message
    assert f", {short} short" in message, message
    # "short" reads as the gap to the limit that would hold the need with the margin: need / 0.9, stated
    assert f"B short ({need / 0.9 / GB:,.2f} GB " in message and "would hold it with a 10% margin" in message
    for more in re.findall(r"([\d,.]+ [KMGT]?B) more", message):
        assert more == short, message


def test_the_ram_preflight_refuses_within_the_margin_and_prints_this_machines_limit(machine):
    workspace, free = machine
    cfg = SEED.replace(n_samples=1000, batch_size=64)
    need = budget.predict_budget(cfg, "cpu").totals["ram"]
    held = PREFLIGHT.ram_already_held(False, False)
    free["ram"] = int((need - held) / 0.95)                # over 90% of what this machine has, under 100%
    message = refusal(cfg, workspace, job="encode", device="cpu")
    short_and_more(message, need, free["ram"] + held)
    batch = int(re.search(r"run\.batch_size=(\d+) \(the largest that fits RAM with a 10% margin\)", message).group(1))
    ok = budget.preflight(cfg.replace(batch_size=batch), workspace, job="encode", device="cpu")
    assert ok.limits["ram"] == free["ram"] + held and ok.fits          # P21: this machine's RAM, not the preset's
    assert f"of {(free['ram'] + held) / GB:.2f} GB" in ok.headline and "this machine" in ok.headline, ok.headline
    assert batch == budget.max_batch_size(cfg, ok.device, drive_quota_gb=ok.options["drive_quota_gb"])
    refusal(cfg.replace(batch_size=batch + 1), workspace, job="encode", device="cpu")


def test_the_vram_preflight_refuses_within_the_margin_counting_the_context_once(machine, monkeypatch):
    import torch

    workspace, _free = machine
    cfg = SEED.replace(n_samples=1000, batch_size=64)
    t4 = budget.DEVICES["t4"]
    need = budget.predict_budget(cfg, "t4").totals["vram"]
    gpu_free = int(need / 0.95) - t4.cuda_context_bytes      # 95% of free + the context: over the margin
    monkeypatch.setattr(PREFLIGHT, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (gpu_free, int(15 * GB)))
    message = refusal(cfg, workspace, job="encode", device="t4")
    short_and_more(message, need, gpu_free + t4.cuda_context_bytes)
    batch = int(re.search(r"run\.batch_size=(\d+)", message).group(1))
    ok = budget.preflight(cfg.replace(batch_size=batch), workspace, job="encode", device="t4")
    assert ok.limits["vram"] == gpu_free + t4.cuda_context_bytes and ok.fits


@pytest.mark.parametrize("share,refused", [(0.95, True), (0.89, False)])
def test_every_disk_check_refuses_by_the_same_rule_and_its_short_is_its_more(machine, share, refused):
    from nblib.encode.disks import check_disks

    workspace, free = machine
    need = int(share * free["disk"])
    checks = {
        "preflight, cache job": lambda: budget.preflight(SEED, workspace, job="cache", disk_bytes=need),
        "check_disk": lambda: budget.check_disk(workspace.cache, need, what="x", knob="y"),
        "encode run's check_disks": lambda: check_disks({"parts still to encode": (workspace.runs, need)}),
    }
    for name, check in checks.items():
        if not refused:
            check()
            continue
        with pytest.raises(nblib.BudgetExceeded) as info:
            check()
        short_and_more(str(info.value), need, free["disk"])
        assert resources.fits(need, free["disk"]) is False, name


def test_the_encode_disk_refusal_offers_as_much_more_disk_as_it_says_short(machine):
    workspace, free = machine
    free["disk"] = 68 * GB
    message = refusal(SEED, workspace, job="encode", device="cpu")
    b = budget.predict_budget(SEED, "cpu")
    short_and_more(message, b.totals["local disk"] + b.totals["drive"], free["disk"])
    assert "GB more free disk on that folder" in message, message


def test_record_shards_and_the_encode_budget_charge_a_process_and_a_worker_alike():
    fit = shard_size_for_ram(11 * 10**9, workers=2)
    charged = {line.what: line.bytes for line in fit.lines}
    encode = {line.name: line.bytes for line in host_memory_lines(SEED.replace(workers=2), cuda=False)}
    assert charged["the main process before data (interpreter, numpy, torch)"] == encode["python + torch runtime"]
    assert charged["2 DataLoader worker(s) before data"] == encode["loader workers"] == 2 * LOADER_WORKER_RAM
    assert fit.peak <= resources.room(11 * 10**9) and encode["python + torch runtime"] == RUNTIME_RAM_CPU


def test_the_plan_and_the_run_count_the_same_disk_items_and_upload_what_drive_holds(tmp_path):
    from nblib.encode.disks import disk_needs
    from nblib.encode.layout import plan_run

    cfg = SEED.replace(n_samples=10_000, batch_size=64, checkpoint_every=10, consolidate_every=10)
    b = budget.predict_budget(cfg, "t4")
    plan = plan_run(cfg, cfg.run.n_samples)
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    needs = disk_needs(cfg, run, mirror, plan, list(range(plan.n_parts)))      # what a fresh run checks
    local = {line.name: line.bytes for line in b.lines["local disk"]}
    drive = {line.name: line.bytes for line in b.lines["drive"] if not line.name.startswith("image cache")}
    assert local == {item: n for item, (folder, n) in needs.items() if folder == run}
    assert drive == {item: n for item, (folder, n) in needs.items() if folder == mirror}
    assert budget.uploaded_bytes(cfg) == b.totals["drive"]         # P1: the bytes uploaded are the quota's peak


def test_the_training_disk_watch_and_consolidate_keep_the_one_margin(tmp_path, monkeypatch):
    """Issue 53's census: train/ops.DiskWatch counted keep_last + 1 states (no best weights, no margin) where the
    budget sizes retention by `training.retained_bytes`, and consolidate refused only past 100% of the free disk.
    Both now ask `retained_bytes` / `resources.fits`: a need at 95% of the room is refused or warned of.
    """
    import importlib
    import warnings

    from nblib.budget.training import retained_bytes
    from nblib.errors import BudgetExceeded
    from nblib.train.ops import DiskWatch

    importlib.import_module("nblib.encode.consolidate")
    consolidate = sys.modules["nblib.encode.consolidate"]          # the module (nblib.encode.consolidate: a function)

    state, best, keep = 1_000_000, 400_000, 3
    need = retained_bytes(state, best, keep)                       # the mirror: what retention keeps there
    mirror = tmp_path / "drive"
    mirror.mkdir()
    for quota, warned in ((int(need / 0.95), True), (int(need / 0.85), False)):
        watch = DiskWatch({"mirror": mirror}, keep, quota_bytes={"mirror": quota})
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            said = watch.check(state, best)
        assert bool(said) is warned, (quota, said)
        assert not said or (f"{nblib.units.fmt_bytes(need)}, with a 10% margin" in said[0]
                            and "best weights" in said[0])
    monkeypatch.setattr(consolidate, "disk_free", lambda _: int(need / 0.95))
    with pytest.raises(BudgetExceeded, match="short with a 10% margin"):
        consolidate._require_free_space(tmp_path, {"children": need})
    monkeypatch.setattr(consolidate, "disk_free", lambda _: int(need / 0.85))
    consolidate._require_free_space(tmp_path, {"children": need})
