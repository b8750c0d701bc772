"""The cache records how much of its texts the font chain can draw, and refuses boxes when asked."""
from __future__ import annotations

import warnings

import pytest
from cli_runner import run_nblib

from nblib.cache import populate
from nblib.cache.format import read_cache_manifest
from nblib.errors import InputError

SCRIPTS_TEXTS = ["Καλημέρα κόσμε", "Привет, мир", "שלום עולם", "مرحبا بالعالم", "สวัสดีชาวโลก",
                 "नमस्ते दुनिया", "你好，世界", "안녕하세요 세계", "hello world"]
EMOJI_TEXTS = ["🦜🦩🦚🪿🦤🪶", "🧋🫖🫗🧉🍵", "ok"]  # mostly emoji: no font of the chain draws these


def test_populate_records_coverage_per_script_in_the_manifest(tmp_path):
    summary = populate(SCRIPTS_TEXTS, tmp_path / "c", image_size=32, shard_mb=1, workers=0, progress=False)
    recorded = read_cache_manifest(tmp_path / "c")["coverage"]
    assert summary.coverage.missing_share == 0
    assert recorded["total_missing"] == 0
    assert {"Greek", "Cyrillic", "Hebrew", "Arabic", "Thai", "Devanagari", "CJK", "Hangul",
            "Latin"} <= set(recorded["characters"])


def test_texts_without_glyphs_warn_and_strict_fonts_refuses_before_writing(tmp_path):
    with pytest.warns(UserWarning, match="no glyph"):
        summary = populate(EMOJI_TEXTS, tmp_path / "warned", image_size=32, shard_mb=1, workers=0,
                           progress=False)
    assert summary.coverage.missing_share > 0.5
    with pytest.raises(InputError, match="no glyph") as refused:
        populate(EMOJI_TEXTS, tmp_path / "strict", image_size=32, shard_mb=1, workers=0, progress=False,
                 strict_fonts=True)
    assert "other" in str(refused.value)
    assert not (tmp_path / "strict").exists() or not any((tmp_path / "strict").iterdir())


def test_cli_strict_fonts_is_one_error_line_and_exit_2(tmp_path):
    texts = tmp_path / "emoji.txt"
    texts.write_text("\n".join(EMOJI_TEXTS) + "\n", encoding="utf-8")
    with warnings.catch_warnings():
        done = run_nblib("cache", "--texts", texts, "--out", tmp_path / "c", "--size", 32, "--shard-mb", 1,
                         "--workers", 0, "--no-progress", "--strict-fonts")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and "no glyph" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
