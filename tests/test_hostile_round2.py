"""Hostile round 2 (issue 20): separators in texts, killed render pools, hostile input files and flags,
a shared and a stalled Drive mirror, a resume on other hardware, damaged outputs, false refusals.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cache_folder_bytes, subprocess_env
from nblib.render import RenderFailed, clean_text, render_params, render_text, render_with
from nblib.store import ForeignMirror
from tests import test_hostile
from tests.test_hostile import (
    THREADS,
    encode_cmd,
    nblib_cmd,
    one_error_line,
    output_hashes,
    race,
    run_cli,
    run_encode,
    start_and_kill,
)

encode_refs = test_hostile.encode_refs  # the fixture: a 128-image smoke cache and solo runs' output hashes
small_fs = test_hostile.small_fs        # the fixture: real size-limited file systems (tmpfs)

# ------------------------------------------------------------------------------ item 5: the renderer


def code_point_classes() -> dict[str, list[int]]:
    """Every code point of each hostile class: controls, separators, format/bidi, unassigned, ..."""
    classes: dict[str, list[int]] = {"controls": [], "separators": [], "spaces": [], "format": [],
                                     "unassigned": [], "surrogates": [], "private use": [], "marks": []}
    by_category = {"Cc": "controls", "Zl": "separators", "Zp": "separators", "Zs": "spaces", "Cf": "format",
                   "Cn": "unassigned", "Cs": "surrogates", "Co": "private use", "Mn": "marks", "Me": "marks"}
    for point in range(0x110000):
        name = by_category.get(unicodedata.category(chr(point)))
        if name:
            classes[name].append(point)
    classes["bidi controls"] = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    classes["noncharacters"] = [*range(0xFDD0, 0xFDF0), *(plane + low for plane in range(0, 0x110000, 0x10000)
                                                         for low in (0xFFFE, 0xFFFF))]
    classes["paragraph bidi"] = [0x0A, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2029]  # bidi class B
    return classes


def hostile_texts(seed: int = 0, per_class: int = 24) -> list[str]:
    """A deterministic sample: each class's code points alone, inside Latin/Hebrew/Arabic words, in runs,
    and mixed with the other classes.
    """
    rng = random.Random(seed)
    classes = code_point_classes()
    texts = []
    for points in classes.values():
        picks = [chr(p) for p in rng.sample(points, min(per_class, len(points)))]
        for c in picks:
            texts += [c, f"a{c}b", f"שלום{c}עולם", f"مرحبا{c}بالعالم", f"{c} x {c}", c * 50, f"e{c}\u0301"]
        texts.append("".join(picks))
    everything = [p for points in classes.values() for p in points]
    texts += ["".join(chr(rng.choice(everything)) for _ in range(rng.randint(1, 120))) for _ in range(200)]
    return texts


def test_paragraph_and_line_separators_break_lines_instead_of_crashing_raqm():
    for separator in ("\u2029", "\u2028"):
        assert clean_text(f"a{separator}b") == "a\nb"
        assert np.array_equal(render_text(f"para{separator}graph", 64), render_text("para\ngraph", 64))
        assert np.array_equal(render_text(f"שלום{separator}עולם", 64), render_text("שלום\nעולם", 64))
    assert render_params(64).version >= 3  # the same params draw other pixels for U+2028 than version 2


def test_every_code_point_class_renders_alone_and_in_context_without_crashing():
    params = render_params(32)
    texts = hostile_texts()
    failed = []
    for text in texts:
        try:
            image = render_with(text, params)
        except Exception as exc:  # noqa: BLE001 - collect every failure, not just the first
            failed.append((text[:20], type(exc).__name__, str(exc)[:60]))
            continue
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert not failed, f"{len(failed)} of {len(texts)} hostile texts failed: {failed[:5]}"


HOSTILE_ALPHABET = sorted({p for points in code_point_classes().values() for p in points[:: max(1, len(points)
                                                                                                // 400)]})


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(HOSTILE_ALPHABET), st.sampled_from([0x61, 0x5D0, 0x627, 0x20])),
                max_size=60))
def test_any_mix_of_hostile_code_points_renders_or_names_the_text(points):
    text = "".join(map(chr, points))
    try:
        image = render_text(text, 32)
    except RenderFailed as exc:  # allowed, but only as the named, typed refusal
        assert "could not draw the text" in str(exc)
        return
    assert image.shape == (32, 32, 3)


def test_a_paragraph_separator_in_a_jsonl_text_builds_the_cache(tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "first"}\n\n{"text": "pasted\u2029from\u2028word"}\n', encoding="utf-8")
    done = run_cli("cache", "--texts", texts, "--out", tmp_path / "cache", "--size", 32, "--workers", 2,
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "2 images" in done.stdout


FAILING_RENDER = """
import nblib.render as render
draw = render._draw_line
def failing(draw_, chain, line, *args):
    if "Q" in line:
        raise RuntimeError("raqm_layout() failed.")
    return draw(draw_, chain, line, *args)
render._draw_line = failing
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("in_sample", [True, False], ids=["sampled-text", "pool-text"])
def test_a_text_the_layout_engine_still_cannot_draw_is_one_error_line_naming_its_jsonl_line(
        tmp_path, workers, in_sample):
    # The layout engine's failure is injected through sitecustomize (so the forkserver's render workers
    # have it too): no real input is known to fail once separators are mapped. What is tested is that
    # the failure reaches the user as one line naming the file's line, from the sample rendered up
    # front and from the pool.
    from nblib.cache.texts import scan_texts

    n = 300
    sample = set(scan_texts([str(i) for i in range(n)], sample_size=64).sample)
    index = next(i for i in range(100, n) if (str(i) in sample) == in_sample)
    records = [{"text": f"text {i}"} for i in range(n)]
    records[index] = {"text": "Q"}
    lines = [json.dumps(r) for r in records]
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n", encoding="utf-8")  # a blank line 6
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAILING_RENDER)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{inject}{os.pathsep}{env['PYTHONPATH']}"
    result = subprocess.run(nblib_cmd("cache", "--texts", texts, "--out", tmp_path / "cache", "--size", 32,
                                      "--workers", workers, "--no-progress", "--shard-mb", 0.01),
                            env=env, capture_output=True, text=True, timeout=300)
    line = one_error_line(result)
    assert f"{texts}: line {index + 2}:" in line and "'Q'" in line and "raqm_layout() failed." in line, line


# ------------------------------------------------------------------------ item 6: killed render pools


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) of every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            table[int(entry)] = (ppid, cmdline)
    return table


def descendants(pid: int) -> dict[int, str]:
    """pid -> cmdline of every process below `pid`."""
    table = process_table()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def still_alive(pids: dict[int, str]) -> dict[int, str]:
    table = process_table()
    return {pid: cmd for pid, cmd in pids.items() if pid in table and table[pid][1] == cmd}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_cache_run_leaves_no_render_worker_and_releases_the_callers_pipes(tmp_path, sig):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"sample {i} {'word ' * (i % 11)}\n" for i in range(30_000)))
    out = tmp_path / "cache"
    process = subprocess.Popen(nblib_cmd("cache", "--texts", texts, "--out", out, "--size", 32, "--workers", 2,
                                         "--shard-mb", 0.05, "--no-progress"),
                               env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tree: dict[int, str] = {}
    try:
        while process.poll() is None:  # until two shards are written and both workers run
            tree.update(descendants(process.pid))
            workers = [p for p, cmd in tree.items() if "forkserver" in cmd]
            if len(list(out.glob("shard-*"))) >= 2 and len(workers) >= 3:  # the server and 2 workers
                break
            time.sleep(0.01)
        assert process.poll() is None, "the run ended before it could be killed"
        process.send_signal(sig)
        process.communicate(timeout=120)  # returns once nothing holds the pipes (hung forever before)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -sig
    deadline = time.monotonic() + 120
    while still_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not still_alive(tree), f"orphans of the killed run: {still_alive(tree)}"


# -------------------------------------------------------------------- item 8: hostile input and flags


def cache_of(texts, out, *extra):
    return run_cli("cache", "--texts", texts, "--out", out, "--size", 32, "--workers", 0, "--no-progress", *extra)


@pytest.mark.parametrize("value, says", [
    ("[" * 100_000 + "]" * 100_000, "nests JSON arrays or objects too deeply"),
    ("9" * 100_000, "integer string conversion"),
], ids=["deep-array", "long-integer"])
def test_a_hostile_value_in_another_jsonl_field_is_one_error_line_naming_the_line(tmp_path, value, says):
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "fine"}\n{"text": "b", "other": ' + value + "}\n")
    line = one_error_line(cache_of(texts, tmp_path / "cache"))
    assert f"{texts}: line 2" in line and says in line and len(line) < 400, line
    assert not (tmp_path / "cache" / "shard-00000.npy").exists()


def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_stripped_and_gives_the_same_cache(tmp_path):
    body = '{"text": "first"}\n{"text": "second"}\n'
    plain, bom = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(body, encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + body.encode())
    for path in (plain, bom):
        done = cache_of(path, tmp_path / path.stem)
        assert done.returncode == 0, done.stderr
    strip = lambda files: {k: v for k, v in files.items() if k != "manifest.json"}  # noqa: E731
    assert strip(cache_folder_bytes(tmp_path / "bom")) == strip(cache_folder_bytes(tmp_path / "plain"))


@pytest.mark.parametrize("verb, flags, says", [
    ("cache", ("--texts", "t.txt", "--out", "c", "--seed", 2 ** 64), "is not a seed"),
    ("cache", ("--texts", "t.txt", "--out", "c", "--seed", 10 ** 30), "is not a seed"),
    ("encode", ("--cache", "c", "--out", "r", "--seed", 2 ** 64), "is not a seed"),
    ("pipeline", ("--cache", "c", "--rss-cap-gb", 1, "--per-sample-ms", "inf"), "--per-sample-ms: inf"),
    ("pipeline", ("--cache", "c", "--rss-cap-gb", 1, "--per-sample-ms", "1e300"), "--per-sample-ms: 1e300"),
    ("pipeline", ("--cache", "c", "--rss-cap-gb", 1, "--per-sample-ms", "nan"), "--per-sample-ms: nan"),
], ids=["cache-seed-2**64", "cache-seed-1e30", "encode-seed-2**64", "per-sample-inf", "per-sample-1e300",
        "per-sample-nan"])
def test_out_of_range_flags_are_one_error_line(tmp_path, verb, flags, says):
    flags = [str(tmp_path / f) if f in ("t.txt", "c", "r") else f for f in flags]
    line = one_error_line(run_cli(verb, *flags))
    assert says in line, line


# ------------------------------------------------------------- items 1 and 2: a shared and a stalled mirror


MIRROR_TRIALS = 3
DEADLINE = {"NBLIB_MIRROR_DEADLINE_S": "3"}


def fresh_resume_from_mirror(cache, mirror, out, seed, refs):
    """A new machine: an empty --out, the same --mirror: nothing re-encoded, the solo run's bytes."""
    done = run_encode(cache, out, seed, "--mirror", mirror)
    assert done.returncode == 0, done.stderr
    assert "already complete" in done.stdout, done.stdout
    assert output_hashes(out) == refs[seed]


@pytest.mark.slow
def test_two_runs_sharing_one_mirror_one_is_refused_naming_the_mirror_and_the_survivor_resumes_alone(
        tmp_path, encode_refs):
    cache, refs = encode_refs
    for trial in range(MIRROR_TRIALS):
        mirror = tmp_path / f"mirror-{trial}"
        outs = [tmp_path / f"run-{trial}-{seed}" for seed in (0, 1)]
        results = race([encode_cmd(cache, outs[seed], seed, "--mirror", mirror) for seed in (0, 1)], **THREADS)
        won = [seed for seed, (_, rc, _, _) in enumerate(results) if rc == 0]
        assert len(won) == 1, (trial, [(rc, err[-400:]) for _, rc, _, err in results])
        loser = results[1 - won[0]]
        line = one_error_line(subprocess.CompletedProcess([], loser[1], loser[2], loser[3]))
        assert f"the mirror folder {mirror} belongs to another run" in line and "--mirror" in line, line
        assert str(outs[1 - won[0]]) in line or "first used from" in line
        assert output_hashes(outs[won[0]]) == refs[won[0]]
    shutil.rmtree(outs[won[0]])                     # the runtime is gone: only the mirror is left
    fresh_resume_from_mirror(cache, mirror, tmp_path / "fresh", won[0], refs)


def test_the_mirror_thread_never_overwrites_a_folder_another_run_claimed(tmp_path):
    from nblib.store import DurableStore, MirrorWarning
    from nblib.store.identity import IDENTITY_FILE

    mirror = tmp_path / "mirror"
    arrays = {"x": np.arange(8, dtype=np.float32)}
    with pytest.warns(MirrorWarning, match="belongs to another run"):
        store = DurableStore(tmp_path / "a", mirror, identity={"run": "a"}, retries=0, backoff_s=0)
        store.write_part("part-000000", arrays)
        assert store.flush()
        claim = json.loads((mirror / IDENTITY_FILE).read_text())
        assert claim["identity"] == {"run": "a"}
        # another run takes the folder over (its owner deleted the claim and started run b there)
        (mirror / IDENTITY_FILE).write_text(json.dumps({**claim, "identity": {"run": "b"}}))
        theirs = {"part-000000": (mirror / "part-000000" / "part.json").read_bytes()}
        store.write_part("part-000001", {"x": np.ones(8, dtype=np.float32)})
        store.write_part("part-000000", {"x": np.zeros(8, dtype=np.float32)})   # rewritten locally
        assert not store.flush()
        status = store.mirror_status()
        store.close()
    assert status.foreign and "belongs to another run" in status.foreign
    assert not (mirror / "part-000001").exists()
    assert (mirror / "part-000000" / "part.json").read_bytes() == theirs["part-000000"]
    with pytest.raises(ForeignMirror, match=f"the mirror folder {mirror} belongs to another run"):
        DurableStore(tmp_path / "c", mirror, identity={"run": "a"})


def wait_for_reader(fifo, process, timeout=300):
    """Open `fifo` for writing once a reader blocks on it (the reader then blocks in read()): the fd."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:                             # ENXIO: no reader yet (ENOENT: not made yet)
            time.sleep(0.002)
    raise AssertionError(f"nothing ever read {fifo}")


def finished(process, timeout=300):
    out, err = process.communicate(timeout=timeout)  # a hang fails here (it hung forever before)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.slow
def test_a_mirror_frozen_at_start_does_not_hang_encode_and_nothing_is_lost(tmp_path, encode_refs):
    cache, refs = encode_refs
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    os.mkfifo(mirror / "manifest.json")             # open() never returns, like a frozen FUSE mount
    process = subprocess.Popen(encode_cmd(cache, tmp_path / "run", 0, "--mirror", mirror),
                               env=subprocess_env(**THREADS, **DEADLINE), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    done = finished(process)
    assert done.returncode == 0, done.stderr
    assert "mirror=stalled" in done.stderr and "read manifest.json" in done.stderr, done.stderr
    assert "the mirror is behind: every part is safe locally" in done.stdout, done.stdout
    assert output_hashes(tmp_path / "run") == refs[0]
    os.unlink(mirror / "manifest.json")             # the mount answers again
    caught_up = run_encode(cache, tmp_path / "run", 0, "--mirror", mirror)
    assert caught_up.returncode == 0 and "mirror is behind" not in caught_up.stdout, caught_up.stderr
    fresh_resume_from_mirror(cache, mirror, tmp_path / "fresh", 0, refs)


@pytest.mark.slow
def test_a_mirror_that_freezes_mid_run_does_not_hang_consolidation_or_the_final_flush(tmp_path, encode_refs):
    cache, refs = encode_refs
    mirror, out = tmp_path / "mirror", tmp_path / "run"
    process = subprocess.Popen(encode_cmd(cache, out, 0, "--mirror", mirror),
                               env=subprocess_env(**THREADS, **DEADLINE), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    held = []
    try:
        while not (out / "parts" / "part-000000" / "part.json").exists() and process.poll() is None:
            time.sleep(0.002)                       # the run read the mirror at start, and encodes
        (mirror / "part-000003").mkdir(parents=True)
        os.mkfifo(mirror / "part-000003" / "part.json")   # the mirror thread freezes copying part 3
        held.append(wait_for_reader(mirror / "part-000003" / "part.json", process))
        os.mkfifo(tmp_path / "frozen")                     # ... and so does the manifest the main thread
        os.replace(tmp_path / "frozen", mirror / "manifest.json")   # reads at consolidation
        done = finished(process)
    finally:
        for fd in held:
            os.close(fd)
    assert done.returncode == 0, done.stderr
    assert "read manifest.json" in done.stderr, done.stderr                 # the consolidation's read
    assert "mirror=stalled" in done.stderr and "blocked on part part-000003" in done.stderr, done.stderr
    assert "the mirror is behind: every part is safe locally" in done.stdout, done.stdout
    assert output_hashes(out) == refs[0]


def test_a_full_mirror_disk_says_free_drive_space_not_check_the_mount(tmp_path, small_fs):
    from nblib.store import DurableStore, MirrorWarning

    mirror = small_fs("drive", 256)
    store = DurableStore(tmp_path / "local", mirror / "m", retries=0, backoff_s=0, retry_interval_s=3600)
    with pytest.warns(MirrorWarning) as caught:
        for k in range(4):
            store.write_part(f"part-{k:06d}", {"x": np.full(40_000, k, dtype=np.float32)})   # 160 KB each
        assert not store.flush(timeout=120)
    store.close(timeout=1)
    said = " ".join(str(w.message) for w in caught)
    assert "No space left on device" in said and "Free Drive space" in said, said
    assert "Check that Drive is mounted" not in said
    assert len(store.list_parts()) == 4            # every part safe locally


# --------------------------------------------------- item 3: a resume on other hardware or precision


@pytest.mark.slow
def test_a_resume_with_other_numerics_is_refused_naming_the_change_and_reencodes_only_when_asked(
        tmp_path, encode_refs):
    # the stand-in for a run started on a T4 (fp16 autocast) and resumed on a CPU runtime (fp32):
    # bf16 autocast on this CPU, killed after 5 parts, then resumed plainly ("auto" is fp32 here)
    cache, refs = encode_refs
    out = tmp_path / "run"
    start_and_kill(encode_cmd(cache, out, 0, "--precision", "bf16"), out / "parts", "part-*/part.json", 5)
    for extra in ((), ("--verify",)):
        line = one_error_line(run_encode(cache, out, 0, *extra))
        assert "precision bf16 -> fp32: this run was started on cpu" in line and "--reencode-numerics" in line, line
    from nblib.encode.numerics import PRECISIONS
    from nblib.trm import PRECISIONS as ENCODER_PRECISIONS

    assert PRECISIONS == ENCODER_PRECISIONS          # the CLI's choices are the encoder's
    done = run_encode(cache, out, 0, "--reencode-numerics")
    assert done.returncode == 0, done.stderr
    assert "encoded 16 of 16 parts" in done.stdout, done.stdout    # the bf16 parts were encoded again
    assert output_hashes(out) == refs[0]                           # a clean fp32 run's bytes


# --------------------------------------------------------------- item 4: damaged consolidated outputs


def flip_a_byte_keeping_mtime(path):
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))          # what bit rot looks like


@pytest.mark.slow
def test_verify_hashes_the_consolidated_outputs_and_rebuilds_a_damaged_one(tmp_path, encode_refs):
    from nblib.encode.consolidate import load_outputs

    cache, refs = encode_refs
    out = tmp_path / "run"
    assert run_encode(cache, out).returncode == 0
    for flags in (("--verify",), ("--consolidate", "--verify")):
        flip_a_byte_keeping_mtime(out / "sketches.npy")
        assert output_hashes(out) != refs[0]
        load_outputs(out)                          # the default load trusts size, header and mtime (README)
        with pytest.raises(Exception, match="sketches.npy"):
            load_outputs(out, verify=True)
        done = run_encode(cache, out, 0, *flags)
        assert done.returncode == 0, done.stderr
        assert "rebuilt" in done.stderr + done.stdout and "sketches.npy" in done.stderr + done.stdout, done
        assert output_hashes(out) == refs[0], flags


# -------------------------------------------------------------- item 9: budget caps at the sample count


@pytest.mark.parametrize("knob", ["batch_size", "checkpoint_every"])
def test_the_budget_caps_batch_and_part_sizes_at_the_number_of_samples(knob):
    from nblib.budget import max_batch_size, predict_budget
    from nblib.config import preset

    config = preset("smoke").replace(n_samples=400, batch_size=32, checkpoint_every=4, consolidate_every=2)
    huge = predict_budget(config.replace(**{knob: 1_000_000_000}), "cpu")
    whole = predict_budget(config.replace(batch_size=400, checkpoint_every=1, consolidate_every=1) if knob ==
                           "batch_size" else config.replace(checkpoint_every=13, consolidate_every=1), "cpu")
    assert huge.totals["ram"] <= whole.totals["ram"] * 1.01, (huge.table(), whole.table())
    assert huge.fits
    assert max_batch_size(config, "t4") <= 400
    # a run too big for the device even at the capped values: what it advises stays within the run
    n = 5000 if knob == "batch_size" else 200_000
    big = preset("seed_t4").replace(n_samples=n, **{knob: 1_000_000_000})
    over = predict_budget(big, "t4")
    batches = -(-n // big.run.batch_size) if knob == "checkpoint_every" else 1
    limits = {"run.batch_size": n, "run.checkpoint_every": batches}
    suggested = [s for a in over.advice for s in a.suggestions if s.knob in limits]
    assert not over.fits and suggested, over.verdict
    assert all(s.value <= limits[s.knob] for s in suggested), suggested


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--checkpoint-every", "--batch-size"])
def test_a_knob_beyond_the_cache_is_not_refused_by_the_preflight(tmp_path, encode_refs, flag):
    cache, refs = encode_refs
    done = run_encode(cache, tmp_path / "run", 0, flag, 1_000_000_000)
    assert done.returncode == 0, done.stderr
    assert "GB more RAM" not in done.stderr


# ------------------------------------------------------------------------------------ item 10: messages


@pytest.mark.slow
def test_a_shard_with_other_settings_is_refused_naming_the_setting(tmp_path, encode_refs):
    cache, _ = encode_refs
    out = tmp_path / "run"
    first = run_encode(cache, out, 0, "--shard", "0/2")
    assert first.returncode == 0, first.stderr
    line = one_error_line(run_encode(cache, out, 0, "--shard", "1/2", "--batch-size", 16))
    assert "batch_size: 8 -> 16" in line, line


@pytest.mark.slow
def test_a_cpu_device_with_an_index_is_one_error_line(tmp_path, encode_refs):
    cache, _ = encode_refs
    line = one_error_line(run_encode(cache, tmp_path / "r", 0, "--device", "cpu:5"))
    assert "device 'cpu:5'" in line and "--device cpu" in line, line
    assert not (tmp_path / "r" / "parts").exists() or not list((tmp_path / "r" / "parts").glob("part-*"))


@pytest.mark.slow
def test_rank_0_of_a_torchrun_launch_reports_every_part_the_launch_encoded(tmp_path, encode_refs):
    cache, refs = encode_refs
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "0", *encode_cmd(cache, out, 0, "--device", "cpu")[1:]]
    done = subprocess.run(command, env=subprocess_env(**THREADS), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "encoded 16 of 16 parts" in done.stdout, done.stdout
    assert output_hashes(out) == refs[0]
