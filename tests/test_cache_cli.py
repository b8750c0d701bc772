"""`python -m nblib cache`: exit codes, one-line errors, damage repaired, SIGKILL resumed."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import cli_runner
import pytest

from conftest import cache_folder_bytes, subprocess_env
from nblib.cache import read_cache_manifest

SIZE = 64
SHARD_MB = 0.05  # 4 raw images of 64 px per shard: many shards, so kills land mid-run


def cache_cmd(*args):
    return [sys.executable, "-m", "nblib", "cache", *map(str, args)]


def run_cli(*args, timeout=None, door="inprocess"):
    return cli_runner.run_cli(["cache", *args], door, timeout=timeout)


def write_texts(path, n):
    path.write_text("".join(f'{{"id": {i}, "body": "sample {i} {"word " * (i % 13)}"}}\n'
                            for i in range(n)))
    return path


def listed_shards(folder):
    try:
        return len(read_cache_manifest(folder)["shards"])
    except Exception:  # no manifest yet, or caught mid-write
        return 0


def one_error_line(result):
    """The run failed with exit 2 and printed exactly one line, `error: ...`, and no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def kill_after(args, folder, shards, timeout=60.0):
    """Start the CLI, SIGKILL its process group once `shards` shard files exist; return the count."""
    process = subprocess.Popen(cache_cmd(*args), env=subprocess_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if len(list(folder.glob("shard-*"))) >= shards:
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended on its own before {shards} shards"
    return listed_shards(folder)


def assert_three_kills_resume_to_the_reference(tmp_path, args, shards):
    """`cache` with `args(out)`, SIGKILLed after 3, 25 and 50 shards, then rerun: the bytes of an unkilled run."""
    reference = tmp_path / "reference"
    done = run_cli(*args(reference))
    assert done.returncode == 0, done.stderr
    total = listed_shards(reference)
    assert total == shards

    killed = tmp_path / "killed"
    seen = [kill_after(args(killed), killed, k) for k in (3, 25, 50)]
    assert seen == sorted(seen) and seen[-1] < total, seen  # each kill landed mid-run, later each time
    interrupted = run_cli("--verify", killed)
    assert interrupted.returncode == 1 and "incomplete" in interrupted.stdout

    resumed = run_cli(*args(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert f"reused {seen[-1]}" in resumed.stdout
    assert cache_folder_bytes(killed) == cache_folder_bytes(reference)
    assert run_cli("--verify", killed).returncode == 0


@pytest.mark.slow
def test_sigkill_at_three_points_then_resume_gives_byte_identical_cache(tmp_path):
    texts = write_texts(tmp_path / "texts.jsonl", 280)
    args = lambda out: ("--texts", texts, "--out", out, "--size", SIZE, "--shard-mb", SHARD_MB,
                        "--workers", 2, "--field", "body", "--no-progress")
    assert_three_kills_resume_to_the_reference(tmp_path, args, shards=70)


@pytest.mark.two_doors
@pytest.mark.slow
def test_verify_exit_codes_follow_damage_and_repair(tmp_path, door):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"line {i} with some words\n" for i in range(60)))
    out = tmp_path / "cache"
    built = run_cli("--texts", texts, "--out", out, "--size", 32, "--shard-mb", 0.05,
                    "--workers", 1, "--codec", "zlib", "--no-progress", door=door)
    assert built.returncode == 0, built.stderr
    assert "60 images" in built.stdout
    ok = run_cli("--verify", out, door=door)
    assert ok.returncode == 0 and "OK" in ok.stdout

    shard = sorted(out.glob("shard-*"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = run_cli("--verify", out, door=door)
    assert bad.returncode == 1 and "corrupt" in bad.stdout and shard.name in bad.stdout
    fixed = run_cli("--verify", "--repair", out, door=door)  # the manifest recorded where the texts are
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "repaired" in fixed.stdout
    assert run_cli("--verify", out, door=door).returncode == 0


@pytest.mark.two_doors
def test_cli_refuses_a_changed_source_with_exit_2_and_one_line(tmp_path, door):
    texts = tmp_path / "texts.txt"
    texts.write_text("a\nb\n")
    out = tmp_path / "cache"
    assert run_cli("--texts", texts, "--out", out, "--size", 16, "--workers", 0, door=door).returncode == 0
    texts.write_text("a\nb\nc\n")
    refused = run_cli("--texts", texts, "--out", out, "--size", 16, "--workers", 0, door=door)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: ") and "--overwrite" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_rerun_repairs_a_same_size_shard_swapped_in_from_another_cache(tmp_path):
    texts, others = tmp_path / "texts.txt", tmp_path / "others.txt"
    texts.write_text("".join(f"line {i}\n" for i in range(40)))
    others.write_text("".join(f"other {i}\n" for i in range(40)))
    flags = ("--size", 32, "--shard-mb", 0.02, "--workers", 0, "--no-progress")
    assert run_cli("--texts", texts, "--out", tmp_path / "a", *flags).returncode == 0
    assert run_cli("--texts", others, "--out", tmp_path / "b", *flags).returncode == 0
    original = cache_folder_bytes(tmp_path / "a")
    shutil.copy2(tmp_path / "b" / "shard-00001.npy", tmp_path / "a" / "shard-00001.npy")
    rerun = run_cli("--texts", texts, "--out", tmp_path / "a", *flags)
    assert rerun.returncode == 0, rerun.stderr
    assert "repaired 1 damaged" in rerun.stdout
    assert cache_folder_bytes(tmp_path / "a") == original


def test_texts_that_are_a_folder_are_named_a_folder(tmp_path):
    (tmp_path / "texts").mkdir()        # beside --out: an --out inside --texts is refused first, for overlapping
    line = one_error_line(run_cli("--texts", tmp_path / "texts", "--out", tmp_path / "c", "--size", 16))
    assert "is a folder, not a file" in line and "does not exist" not in line


@pytest.mark.two_doors
@pytest.mark.parametrize("content", ["", "\n \n\n"])
def test_an_empty_or_blank_jsonl_is_refused_and_makes_no_cache(tmp_path, door, content):
    texts = tmp_path / "texts.jsonl"
    texts.write_text(content)
    line = one_error_line(run_cli("--texts", texts, "--out", tmp_path / "c", "--size", 16, door=door))
    assert "no text to render" in line
    assert not (tmp_path / "c").exists()


@pytest.mark.two_doors
def test_verify_of_a_missing_folder_is_one_error_line(tmp_path, door):
    line = one_error_line(run_cli("--verify", tmp_path / "nope", door=door))
    assert "does not exist" in line


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "many"])
def test_a_shard_mb_that_is_not_a_finite_positive_number_is_one_error_line(tmp_path, value):
    texts = tmp_path / "texts.txt"
    texts.write_text("a\n")
    line = one_error_line(run_cli("--texts", texts, "--out", tmp_path / "c", "--shard-mb", value))
    assert "--shard-mb" in line
    assert not (tmp_path / "c").exists()
