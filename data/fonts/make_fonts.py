"""Rebuild the fonts shipped in data/fonts/ from Debian's font packages (copies plus one CJK subset).

    apt-get download fonts-dejavu-core fonts-noto-core fonts-noto-cjk
    for d in *.deb; do dpkg -x "$d" debroot; done
    python data/fonts/make_fonts.py debroot        # or / where the packages are installed

DejaVu Sans is copied unchanged. The Noto fonts lose their hinting (FreeType autohints them: Thai and
Devanagari draw 3-4x faster at 8-14 px, CJK 1.2x, files are smaller): Thai and Devanagari keep every
glyph and layout table; the CJK font is Noto Sans CJK SC (face 2 of NotoSansCJK-Regular.ttc) cut to
SUBSET_RULE. Needs fontTools.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

FONTS_DIR = Path(__file__).resolve().parent
SAMPLE_TEXTS = FONTS_DIR.parent / "sample_texts.jsonl"
COPIED = {  # shipped name: path inside the Debian packages
    "DejaVuSans.ttf": "usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
}
DEHINTED = {
    "NotoSansThai-Regular.ttf": "usr/share/fonts/truetype/noto/NotoSansThai-Regular.ttf",
    "NotoSansDevanagari-Regular.ttf": "usr/share/fonts/truetype/noto/NotoSansDevanagari-Regular.ttf",
}
CJK_SOURCE = "usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"
CJK_FACE = 2  # Noto Sans CJK SC
CJK_SUBSET = "NotoSansCJKsc-Subset.otf"
SUBSET_RULE = ("GB2312 level-1 Hanzi (3,755) + Big5 level-1 Hanzi (5,401) + JIS X 0208 level-1 Kanji (2,965) + "
               "KS X 1001 Hangul "
               "syllables (2,350) + Kana, CJK punctuation, Hangul compatibility jamo, half/full-width "
               "forms + every character of data/sample_texts.jsonl that the fonts before it lack")
BLOCKS = [(0x3000, 0x30FF), (0x3130, 0x318F), (0x31F0, 0x31FF), (0xFF00, 0xFFEF)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder holding usr/share/fonts/... (e.g. dpkg -x output or /)")
    args = parser.parse_args()
    for name, inside in COPIED.items():
        shutil.copyfile(args.root / inside, FONTS_DIR / name)
    for name, inside in DEHINTED.items():
        write_subset(args.root / inside, FONTS_DIR / name, face=-1, unicodes=None)
    write_subset(args.root / CJK_SOURCE, FONTS_DIR / CJK_SUBSET, face=CJK_FACE, unicodes=cjk_code_points())
    for name in [*COPIED, *DEHINTED, CJK_SUBSET]:
        path = FONTS_DIR / name
        print(f"{name}  {path.stat().st_size:>9,} bytes  sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}")


def write_subset(source: Path, out: Path, face: int, unicodes: set[int] | None) -> None:
    """Write `unicodes` of a font face (None: every glyph, all names) without hinting; byte-deterministic."""
    from fontTools import subset

    options = subset.Options()
    options.font_number = face
    options.hinting = False
    if unicodes is None:
        options.layout_features = ["*"]
        options.name_IDs = ["*"]
        options.name_languages = ["*"]
        options.notdef_outline = True
        options.glyph_names = True
    font = subset.load_font(str(source), options)
    subsetter = subset.Subsetter(options)
    if unicodes is None:
        subsetter.populate(glyphs=font.getGlyphOrder(), unicodes=font.getBestCmap())
    else:
        subsetter.populate(unicodes=sorted(unicodes))
    subsetter.subset(font)
    subset.save_font(font, str(out), options)


def cjk_code_points() -> set[int]:
    """The code points SUBSET_RULE names."""
    from fontTools.ttLib import TTFont

    chars = {*_legacy_rows("gb2312", 16, 55), *_big5_level1(), *_legacy_rows("euc_jp", 16, 47),
             *_legacy_rows("euc_kr", 16, 40)}
    points = {ord(c) for c in chars} | {p for lo, hi in BLOCKS for p in range(lo, hi + 1)}
    earlier = set()
    for name in [*COPIED, *DEHINTED]:
        earlier |= set(TTFont(str(FONTS_DIR / name)).getBestCmap())
    with SAMPLE_TEXTS.open(encoding="utf-8") as lines:
        sample = {ord(c) for line in lines for c in json.loads(line)["text"]}
    return points | (sample - earlier)


def _legacy_rows(codec: str, first_row: int, last_row: int) -> list[str]:
    """The characters of rows first_row..last_row of a 94x94 EUC code (GB2312, JIS X 0208, KS X 1001)."""
    out = []
    for row in range(first_row, last_row + 1):
        for cell in range(1, 95):
            try:
                out.append(bytes([0xA0 + row, 0xA0 + cell]).decode(codec))
            except UnicodeDecodeError:
                pass
    return out


def _big5_level1() -> list[str]:
    """Big5's 5,401 frequently used Hanzi (lead bytes 0xA4..0xC6, up to 0xC67E)."""
    out = []
    for lead in range(0xA4, 0xC7):
        for trail in [*range(0x40, 0x7F), *range(0xA1, 0xFF)]:
            if (lead, trail) > (0xC6, 0x7E):
                break
            try:
                out.append(bytes([lead, trail]).decode("big5"))
            except UnicodeDecodeError:
                pass
    return out


if __name__ == "__main__":
    main()
