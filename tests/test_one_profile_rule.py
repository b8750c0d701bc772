"""One default profile for every verb: `nblib.env.profile()` (NBLIB_PROFILE, else t4 with CUDA, smoke without).

`train --profile` hard-coded smoke while `encode` and `cache` followed NBLIB_PROFILE, so a Colab user who
dropped `--profile smoke` still trained the tiny model. And a cache of another image size is refused before
torch is imported, naming the cache command that builds one of the right size.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_nblib

REPO = Path(__file__).resolve().parents[1]


def _texts(folder: Path, n: int) -> Path:
    lines = (REPO / "data" / "sample_texts.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    path = folder / "texts.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _cache(folder: Path, size: int) -> Path:
    from nblib.cache import populate

    folder.mkdir(parents=True, exist_ok=True)
    populate(_texts(folder, 24), folder / "cache", image_size=size, shard_mb=0.5, workers=0, progress=False)
    return folder / "cache"


def _image_size(cache: Path) -> int:
    from nblib.cache import ShardedImageCache

    return ShardedImageCache(cache).image_size


def test_train_without_profile_trains_the_nblib_profile_model(tmp_path):
    cache = _cache(tmp_path / "c64", 64)
    run = run_nblib("train", "--cache", cache, "--out", tmp_path / "run", "--steps", "1", "--no-progress",
                    NBLIB_PROFILE="t4")
    assert run.returncode != 0, run.stdout             # the old default trained the 64 px smoke model here
    assert "--profile t4 takes 224x224" in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("profile, size", [("smoke", 64), ("t4", 224)])
def test_every_verb_takes_its_default_profile_from_the_one_function(tmp_path, profile, size, monkeypatch):
    from nblib import env
    from nblib.cli.encode import _encode_config, _encode_parser
    from nblib.cli.train import _train_args
    from nblib.config import for_profile

    monkeypatch.setenv("NBLIB_PROFILE", profile)
    assert env.profile() == profile
    trained = _train_args(["--cache", "c", "--out", "o", "--steps", "1"]).profile
    encoded = _encode_config(_encode_parser().parse_args(["--cache", "c", "--out", "o"]), env.profile())
    assert trained == profile and encoded.model == for_profile(profile).model
    assert run_nblib("cache", "--texts", _texts(tmp_path, 2), "--out", tmp_path / "cache", "--field", "text",
                     "--no-progress", NBLIB_PROFILE=profile).returncode == 0
    assert _image_size(tmp_path / "cache") == size


def test_train_on_a_32_px_cache_names_the_cache_command_that_fixes_it(tmp_path):
    cache = _cache(tmp_path / "c32", 32)
    run = run_nblib("train", "--cache", cache, "--out", tmp_path / "run", "--steps", "1", "--profile", "smoke")
    assert run.returncode != 0
    line = run.stderr.strip()
    assert "holds 32x32 images" in line and "takes 64x64" in line, line
    assert "python -m nblib cache --images DIR --size 64 --out NEW" in line, line
    assert "image_size=" not in line and len(line.splitlines()) == 1, line


def test_a_224_px_cache_under_the_smoke_default_names_the_t4_profile(tmp_path):
    cache = _cache(tmp_path / "c224", 224)
    run = run_nblib("train", "--cache", cache, "--out", tmp_path / "run", "--steps", "1", NBLIB_PROFILE="smoke")
    line = run.stderr.strip()
    assert run.returncode != 0 and "the TRM of --profile smoke takes 64x64" in line, line
    assert line.endswith("or train with --profile t4 (a 224 px TRM)"), line


def test_train_refusals_that_need_no_model_answer_before_torch_is_imported(tmp_path):
    """Issue 53: refusals that need no model took ~20 s under load, torch imported first (--records' fields did)."""
    import subprocess
    import sys

    small = _cache(tmp_path / "c32", 32)
    code = ("import sys\nfrom nblib.cli import main\nstatus = main(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules)\nsys.exit(status)")
    for argv in (["--records", str(tmp_path / "none"), "--input-key", "x", "--target-key", "y"],
                 ["--cache", str(small), "--profile", "smoke"]):
        run = subprocess.run([sys.executable, "-c", code, "train", *argv, "--out", str(tmp_path / "run"),
                              "--steps", "1"], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and run.stderr.startswith("error: "), run.stderr
        assert "torch imported: False" in run.stdout, (argv, run.stdout, run.stderr)
