"""nblib.render: every script drawn with real glyphs, shaped, deterministic, wrapped, truncated, any input."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nblib.atomic import sha256_file
from nblib.errors import ConfigError, InputError
from nblib.render import (
    FONTS_DIR,
    RENDER_VERSION,
    SHIPPED_FONTS,
    RenderParams,
    _chain,
    _wrap,
    clean_text,
    coverage,
    font_chain,
    max_lines_for,
    render_params,
    render_text,
    render_with,
    script_of,
)
from tests.conftest import REPO


def layout_lines(text: str, params: RenderParams) -> list[str]:
    """The lines render_with draws (greedy word wrap; what does not fit is dropped), without their direction."""
    return [line for line, _ in _wrap(text, params)]


# Two distinct strings per script, of equal length: PIL's built-in font drew each pair as the same boxes.
SCRIPT_PAIRS = {
    "Latin": ("hello", "world"),
    "Greek": ("καλημέρα", "καληνύχτ"),
    "Cyrillic": ("привет", "машина"),
    "Hebrew": ("שלום", "עולם"),
    "Arabic": ("مرحبا", "كتابة"),
    "Thai": ("สวัสดี", "ประเทศ"),
    "Devanagari": ("नमस्ते", "दुनिया"),
    "CJK": ("中文字体", "日本語文"),
    "Hangul": ("안녕하세요", "한국어입니"),
}
SHAPING_SIZE = {"size": 224, "font_size": 40}  # big glyphs, so ink boxes measure the shaping


def sample_texts() -> list[str]:
    with (REPO / "data" / "sample_texts.jsonl").open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines]


def ink_box(image: np.ndarray) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) of the dark pixels, inclusive."""
    dark = image[..., 0] < 128
    cols, rows = np.flatnonzero(dark.any(0)), np.flatnonzero(dark.any(1))
    return int(cols[0]), int(cols[-1]), int(rows[0]), int(rows[-1])


def ink_width(image: np.ndarray) -> int:
    left, right, _, _ = ink_box(image)
    return right - left + 1


def ink_glyphs(image: np.ndarray) -> list[tuple[int, int]]:
    """(left, right) column spans of ink separated by blank columns, left to right."""
    dark = np.concatenate([[False], (image[..., 0] < 128).any(0), [False]])
    edges = np.flatnonzero(np.diff(dark.astype(np.int8)))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2])]


def ink(image: np.ndarray) -> np.ndarray:
    """The image cropped to its dark pixels (one channel)."""
    left, right, top, bottom = ink_box(image)
    return image[top:bottom + 1, left:right + 1, 0]


# ------------------------------------------------------------------------------ every script


@pytest.mark.parametrize("script", SCRIPT_PAIRS)
def test_two_distinct_strings_of_each_script_give_different_images(script):
    a, b = SCRIPT_PAIRS[script]
    for size in (64, 224):
        assert not np.array_equal(render_text(a, size), render_text(b, size)), (script, size)


@pytest.mark.parametrize("script", SCRIPT_PAIRS)
def test_each_script_has_glyphs_for_nearly_every_character(script):
    found = coverage(SCRIPT_PAIRS[script])
    assert set(found.characters) == {script}
    assert found.missing_share_of(script) <= 0.10


def test_no_two_sample_texts_with_different_visible_lines_share_an_image():
    """Over data/sample_texts.jsonl, equal images only where the laid-out lines are equal (cut off)."""
    texts = sorted(set(sample_texts()))
    for size in (64, 224):
        params = render_params(size)
        by_image = defaultdict(set)
        for text in texts:
            visible = tuple(line.rstrip() for line in layout_lines(clean_text(text), params))
            by_image[hashlib.sha256(render_with(text, params).tobytes()).hexdigest()].add(visible)
        shared = [sorted(v) for v in by_image.values() if len(v) > 1]
        assert not shared, f"{size} px: {len(shared)} images shared by distinct visible texts: {shared[:3]}"


def test_the_chain_has_glyphs_for_99_percent_of_the_sample_characters():
    found = coverage(sample_texts())
    assert found.total_characters > 200_000
    assert found.missing_share <= 0.01, str(found)
    for script in ("Latin", "Greek", "Cyrillic", "Hebrew", "Arabic", "Thai", "Devanagari", "CJK", "Hangul", "Kana"):
        assert found.characters[script] > 0 and found.missing[script] == 0, str(found)


def test_coverage_counts_per_script_ignores_spaces_and_punctuation_and_reports_emoji_missing():
    found = coverage(["ab, c! 中\u3002 😀👍🏽 ", "\u0000\t"])
    assert found.characters == {"Latin": 3, "CJK": 1, "other": 3}
    assert found.missing == {"Latin": 0, "CJK": 0, "other": 2}  # DejaVu has 😀, nothing has 👍 or 🏽
    assert found.total_missing == 2 and found.missing_share == pytest.approx(2 / 7)
    recorded = json.loads(json.dumps(found.as_dict()))
    assert recorded["total_characters"] == 7 and recorded["missing_share"]["other"] == pytest.approx(2 / 3, abs=1e-6)
    assert "total" in str(found)


@pytest.mark.parametrize("char, script", [("a", "Latin"), ("é", "Latin"), ("λ", "Greek"), ("ж", "Cyrillic"),
                                          ("ש", "Hebrew"), ("م", "Arabic"), ("ก", "Thai"), ("क", "Devanagari"),
                                          ("中", "CJK"), ("한", "Hangul"), ("か", "Kana"), ("😀", "other")])
def test_script_of_names_the_script_of_a_character(char, script):
    assert script_of(char) == script


# ------------------------------------------------------------------------------ shaping against references


def test_arabic_is_joined_and_right_to_left_exactly_like_its_presentation_forms_in_visual_order():
    shaped = render_with("سلام", render_params(**SHAPING_SIZE))
    basic = render_params(**SHAPING_SIZE, layout="basic")
    # reference: final mim, lam-alef ligature, initial seen, written left to right without shaping
    reference = render_with("\ufee1\ufefc\ufeb3", basic)
    assert np.array_equal(ink(shaped), ink(reference))
    unshaped = render_with("سلام", basic)  # isolated forms in logical order
    assert not np.array_equal(ink(shaped), ink(unshaped)) and ink_width(shaped) < ink_width(unshaped)


def test_hebrew_first_logical_letter_is_rightmost_and_the_line_is_right_aligned():
    params = render_params(**SHAPING_SIZE)
    first, second, both = (ink_glyphs(render_with(t, params)) for t in ("ש", "ל", "ש ל"))
    assert len(first) == len(second) == 1 and len(both) == 2
    width = lambda glyph: glyph[1] - glyph[0]
    assert width(first[0]) != width(second[0])
    assert abs(width(both[-1]) - width(first[0])) <= 1 and abs(width(both[0]) - width(second[0])) <= 1
    assert abs(both[-1][1] - first[0][1]) <= 1 and first[0][1] > params.size - params.margin - 8  # right-aligned
    logical = ink_glyphs(render_with("ש ל", render_params(**SHAPING_SIZE, layout="basic")))
    assert abs(width(logical[-1]) - width(second[0])) <= 1  # the unshaped reference puts ל at the right


def test_devanagari_vowel_sign_combines_with_its_consonant_instead_of_a_dotted_circle():
    params = render_params(**SHAPING_SIZE)
    ka, sign, ki = (render_with(t, params) for t in ("क", "\u093f", "कि"))
    assert ink_width(ki) < 0.85 * (ink_width(ka) + ink_width(sign))  # the sign alone carries a dotted circle
    assert not np.array_equal(ki, render_with("कि", render_params(**SHAPING_SIZE, layout="basic")))
    conjunct, halves = render_with("क्ष", params), render_with("क्ष", render_params(**SHAPING_SIZE, layout="basic"))
    assert ink_width(conjunct) < 0.7 * ink_width(halves)  # क्ष is one conjunct glyph, not क + ् + ष


def test_thai_marks_stack_above_their_consonant_without_advancing():
    params = render_params(**SHAPING_SIZE)
    base, cluster = render_with("ก", params), render_with("กี่", params)
    assert ink_box(cluster)[:2] == ink_box(base)[:2]  # same horizontal extent: the marks do not advance
    assert ink_box(cluster)[2] < ink_box(base)[2] - 10  # vowel and tone mark sit above
    unshaped = render_with("กี่", render_params(**SHAPING_SIZE, layout="basic"))
    assert ink_box(cluster)[2] < ink_box(unshaped)[2]  # the tone mark is lifted above the vowel


# ------------------------------------------------------------------------------ params and fonts


def test_params_name_every_font_by_sha256_the_layout_and_the_new_version():
    params = render_params(224)
    recorded = json.loads(json.dumps(params.as_dict()))
    assert RENDER_VERSION >= 2 and recorded["version"] == RENDER_VERSION
    assert recorded["layout"] in ("raqm", "basic")
    assert [f["file"] for f in recorded["fonts"]] == list(SHIPPED_FONTS)
    assert [f["sha256"] for f in recorded["fonts"]] == [sha256_file(FONTS_DIR / name) for name in SHIPPED_FONTS]
    assert RenderParams(**recorded) == params  # a manifest's dict gives the same params back
    assert params != render_params(224, layout="basic")


def test_fonts_ship_with_their_licenses_and_stay_small():
    files = [p for p in FONTS_DIR.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 10e6
    names = {p.name for p in files}
    assert set(SHIPPED_FONTS) <= names and {"LICENSE-DejaVu.txt", "OFL-Noto.txt", "README.md"} <= names


def test_a_changed_font_file_is_refused_with_both_sha256(tmp_path):
    copy = tmp_path / "cjk.otf"
    shutil.copyfile(FONTS_DIR / SHIPPED_FONTS[-1], copy)
    params = render_params(64, cjk_font=str(copy))
    assert params.fonts[-1].file == str(copy) and np.array_equal(render_with("中文", params), render_text("中文", 64))
    changed = RenderParams(**{**params.as_dict(), "size": 65})
    copy.write_bytes(copy.read_bytes() + b"\0")
    with pytest.raises(ConfigError, match="sha256"):
        render_with("中文", changed)


def test_cjk_font_comes_from_the_environment_by_name_or_path(tmp_path, monkeypatch):
    copy = tmp_path / "MyCJK.otf"
    shutil.copyfile(FONTS_DIR / SHIPPED_FONTS[-1], copy)
    monkeypatch.setenv("NBLIB_CJK_FONT", str(copy))
    assert font_chain()[-1].file == str(copy.resolve())
    monkeypatch.setenv("NBLIB_CJK_FONT", "NoSuchFont-Regular.ttc#2")
    with pytest.raises(ConfigError, match="NoSuchFont-Regular.ttc.*fonts-noto-cjk"):
        render_params(64)


def test_unknown_layout_engine_is_refused():
    with pytest.raises(ConfigError, match="layout='fancy'"):
        render_params(64, layout="fancy")


# ------------------------------------------------------------------------------ deterministic bytes


def test_same_text_gives_identical_bytes_in_this_and_a_fresh_process():
    texts = ["The quick brown fox 12345 ½ ∑ café", *[a + " " + b for a, b in SCRIPT_PAIRS.values()]]
    here = [hashlib.sha256(render_text(t, 64).tobytes()).hexdigest() for t in texts]
    assert here == [hashlib.sha256(render_text(t, 64).tobytes()).hexdigest() for t in texts]
    code = ("import hashlib, json, sys; from nblib.render import render_text; "
            "print(json.dumps([hashlib.sha256(render_text(t, 64).tobytes()).hexdigest() "
            "for t in json.load(sys.stdin)]))")
    fresh = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True,
                           text=True, check=True, cwd=REPO)
    assert json.loads(fresh.stdout) == here


@pytest.mark.parametrize("size", [32, 64, 224])
def test_image_is_square_uint8_rgb_of_the_asked_size(size):
    image = render_text("hello world", size)
    assert image.shape == (size, size, 3) and image.dtype == np.uint8
    assert image.flags.c_contiguous and image.flags.writeable


def test_text_draws_dark_pixels_and_different_texts_differ():
    a, b = render_text("alpha", 64), render_text("omega", 64)
    assert (a < 128).any() and (b < 128).any()
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("text", ["", "   ", "\n\n\n", "\t", "\x00\x01\x1f\x7f"])
def test_empty_or_invisible_text_gives_blank_white_image(text):
    image = render_text(text, 32)
    assert (image == 255).all()


def test_control_characters_and_nul_are_stripped():
    assert np.array_equal(render_text("a\x00b\x07c\x1b\x9f", 64), render_text("abc", 64))
    assert clean_text("a\x00b\tc\r\nd\re") == "ab c\nd\ne"


def test_lone_surrogates_are_stripped_not_crashing():
    assert clean_text("x\ud800y\udfffz") == "xyz"
    assert np.array_equal(render_text("x\ud800y", 64), render_text("xy", 64))


# ------------------------------------------------------------------------------ wrapping and truncation


@pytest.mark.parametrize("text", ["word " * 200, "Ελληνικά кириллица " * 40, "שלום עולם " * 40,
                                  "مرحبا بالعالم " * 40, "สวัสดีชาวโลก" * 30, "नमस्ते दुनिया " * 40,
                                  "中文字体日本語한국어" * 40])
def test_long_text_wraps_into_lines_that_fit_the_width(text):
    params = render_params(64)
    lines = layout_lines(text, params)
    assert len(lines) == max_lines_for(params) > 1
    chain = _chain(params)
    assert all(chain.measure(line) <= params.size - 2 * params.margin for line in lines)


def test_a_word_longer_than_the_width_is_broken_across_lines():
    lines = layout_lines("x" * 500, render_params(64))
    assert len(lines) > 1 and all(set(line) == {"x"} for line in lines)


def test_a_long_word_breaks_between_clusters_never_before_a_mark():
    for word in ("कि" * 200, "กี่" * 200, "e\u0301" * 300):
        lines = layout_lines(word, render_params(64))
        assert len(lines) > 1 and all(clean_text(line)[0] in "कกe" for line in lines)


@pytest.mark.parametrize("unit", ["a", "中", "ก", "م"])
def test_hundred_thousand_char_line_is_truncated_to_what_fits_quickly(unit):
    long = unit * 100_000
    render_text(long[:10], 224)  # fonts loaded
    assert np.array_equal(render_text(long, 224), render_text(long[:5_000], 224))
    # bounded work: 20x the text costs about what 5,000 characters cost. A ratio of this thread's CPU
    # time (not wall time, which other processes stretch), the best of 5 each, taken side by side;
    # work that grows with the text would be ~20x (measured on an idle machine: 1.1-2x)
    seconds = {5_000: [], 100_000: []}
    for _ in range(5):
        for n, times in seconds.items():
            start = time.thread_time()
            render_text(long[:n], 224)
            times.append(time.thread_time() - start)
    assert min(seconds[100_000]) < 6 * min(seconds[5_000]), seconds


def test_text_beyond_the_last_line_is_dropped():
    params = render_params(32)
    n = max_lines_for(params)
    fits = "\n".join(["ab"] * n)
    assert np.array_equal(render_text(fits + "\nEXTRA LINE", 32), render_text(fits, 32))


@pytest.mark.parametrize("text", [
    "😀👍🏽👨‍👩‍👧🇺🇳", "שלום עולם", "مرحبا بالعالم", "e\u0301\u0302\u0303 a\u20dd",
    "\u200f\u202e reversed \u202c", "中文字 日本語 한국어", "\ufeff\ufffe\uffff", "\U0010ffff\ue000",
    "\u0000" * 1000, "\n" * 100_000, " " * 100_000, "\u093f\u0e48\u064b", "a\u200db\u200c",
])
def test_hostile_unicode_renders_without_crashing(text):
    image = render_text(text, 64)
    assert image.shape == (64, 64, 3)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_any_unicode_string_renders_deterministically(text):
    first = render_text(text, 32)
    assert first.shape == (32, 32, 3) and first.dtype == np.uint8
    assert np.array_equal(first, render_text(text, 32))


def test_non_string_input_is_refused_with_input_error():
    with pytest.raises(InputError, match="needs a str"):
        render_text(b"bytes", 32)


def test_too_small_image_size_is_refused_with_the_number():
    with pytest.raises(ConfigError, match="size=4"):
        render_text("x", 4)
