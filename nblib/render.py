"""Text -> uint8 image: black text on white in a chain of shipped fonts, shaped, wrapped, truncated.

Trade-off: each character is drawn with the first font of a small shipped chain that has a glyph
for it (DejaVu Sans for Latin, Greek, Cyrillic, Hebrew, Arabic and symbols; Noto Sans Thai,
Devanagari and a CJK subset after it), and runs are shaped by libraqm, so Arabic joins,
right-to-left paragraphs run and align right, and marks combine. That costs a few MB of fonts in
the repo and ties the pixels to the font files and the layout engine: both are in `RenderParams`
(each font's sha256), so a cache drawn with other fonts is refused, never mixed. Without libraqm
the basic layout draws unshaped glyphs in logical order, with a warning and `layout="basic"` in
the params. Runs of different fonts in one line are placed in logical order. Emoji have no glyph
(see `coverage`). Control characters, NUL and lone surrogates are stripped, U+2028 and U+2029
break lines; an empty text gives a blank image, and a text the layout engine still cannot draw
raises `RenderFailed` (an InputError) instead of the engine's own error. Work is capped by the
image: text that cannot fit is cut before it is measured, so a 100,000-character line costs no
more than a full image.
"""
from __future__ import annotations

import bisect
import functools
import os
import re
import unicodedata
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from nblib.atomic import sha256_file
from nblib.errors import ConfigError, InputError

RENDER_VERSION = 3  # bump when the same params would draw different pixels (3: U+2028/U+2029 break lines)
BACKGROUND = 255
INK = 0
FONTS_DIR = Path(__file__).resolve().parents[1] / "data" / "fonts"
SHIPPED_FONTS = ("DejaVuSans.ttf", "NotoSansThai-Regular.ttf", "NotoSansDevanagari-Regular.ttf",
                 "NotoSansCJKsc-Subset.otf")  # the chain, first match wins; the last one is the CJK slot
CJK_FONT_ENV = "NBLIB_CJK_FONT"  # a font file name or path (`NotoSansCJK-Regular.ttc#2`) for the CJK slot
SYSTEM_FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "~/.local/share/fonts", "~/.fonts",
                    "/Library/Fonts", "/System/Library/Fonts", "C:/Windows/Fonts")
LAYOUTS = ("raqm", "basic")
SCRIPTS = ("Latin", "Greek", "Cyrillic", "Hebrew", "Arabic", "Thai", "Devanagari", "CJK", "Hangul", "Kana",
           "other")

# C0 and C1 control characters (tab becomes a space, newline is kept) and lone surrogates. The line
# and paragraph separators U+2028 and U+2029 (text pasted from Word or PDF) break lines as a newline
# does: libraqm refuses a paragraph separator inside one run.
_CONTROL_TABLE = {c: None for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}
_CONTROL_TABLE.update({ord("\t"): " ", ord("\n"): "\n", 0x2028: "\n", 0x2029: "\n"})
_SURROGATES = re.compile("[\ud800-\udfff]")
# Characters that belong to the cluster before them: never a run or line break before them.
_JOINERS = frozenset("\u200c\u200d") | frozenset(map(chr, range(0xFE00, 0xFE10))) | frozenset(
    map(chr, range(0x1F3FB, 0x1F400)))
# Code-point ranges of the scripts `coverage` reports (first, last, script), sorted.
_SCRIPT_RANGES = sorted([
    (0x0000, 0x036F, "Latin"), (0x1D00, 0x1DFF, "Latin"), (0x1E00, 0x1EFF, "Latin"), (0x2C60, 0x2C7F, "Latin"),
    (0xA720, 0xA7FF, "Latin"), (0xAB30, 0xAB6F, "Latin"), (0xFB00, 0xFB06, "Latin"), (0xFF21, 0xFF5A, "Latin"),
    (0x0370, 0x03FF, "Greek"), (0x1F00, 0x1FFF, "Greek"),
    (0x0400, 0x052F, "Cyrillic"), (0x1C80, 0x1C8F, "Cyrillic"), (0x2DE0, 0x2DFF, "Cyrillic"),
    (0xA640, 0xA69F, "Cyrillic"),
    (0x0590, 0x05FF, "Hebrew"), (0xFB1D, 0xFB4F, "Hebrew"),
    (0x0600, 0x06FF, "Arabic"), (0x0750, 0x077F, "Arabic"), (0x08A0, 0x08FF, "Arabic"),
    (0xFB50, 0xFDFF, "Arabic"), (0xFE70, 0xFEFF, "Arabic"),
    (0x0E00, 0x0E7F, "Thai"), (0x0900, 0x097F, "Devanagari"), (0xA8E0, 0xA8FF, "Devanagari"),
    (0x2E80, 0x2FDF, "CJK"), (0x3000, 0x303F, "CJK"), (0x3400, 0x4DBF, "CJK"), (0x4E00, 0x9FFF, "CJK"),
    (0xF900, 0xFAFF, "CJK"), (0x20000, 0x3FFFF, "CJK"),
    (0x1100, 0x11FF, "Hangul"), (0x3130, 0x318F, "Hangul"), (0xA960, 0xA97F, "Hangul"),
    (0xAC00, 0xD7FF, "Hangul"), (0xFFA0, 0xFFDC, "Hangul"),
    (0x3040, 0x30FF, "Kana"), (0x31F0, 0x31FF, "Kana"), (0xFF66, 0xFF9F, "Kana"), (0x1B000, 0x1B16F, "Kana"),
])
_RANGE_STARTS = [first for first, _, _ in _SCRIPT_RANGES]


@dataclass(frozen=True)
class FontFile:
    """One font of the chain: a file name in data/fonts/ or an absolute path, its face index, its sha256."""

    file: str
    index: int
    sha256: str


@dataclass(frozen=True)
class RenderParams:
    """Everything that decides the pixels: sizes, spacing, layout engine and every font's sha256.

    `RenderParams(**params.as_dict())` gives the same params back (a cache manifest stores the dict).
    Left out, `layout` is raqm where Pillow has it and `fonts` the shipped chain (NBLIB_CJK_FONT
    honoured).
    """

    size: int = 224
    font_size: int = 14
    margin: int = 4
    line_spacing: int = 2
    version: int = RENDER_VERSION
    layout: str = ""
    fonts: tuple[FontFile, ...] = field(default=())

    def __post_init__(self):
        fonts = tuple(f if isinstance(f, FontFile) else FontFile(**f) for f in self.fonts) or font_chain()
        object.__setattr__(self, "fonts", fonts)
        object.__setattr__(self, "layout", self.layout or default_layout())

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Coverage:
    """Characters counted per script (letters, marks, digits, symbols) and how many have no glyph."""

    characters: dict
    missing: dict

    @property
    def total_characters(self) -> int:
        return sum(self.characters.values())

    @property
    def total_missing(self) -> int:
        return sum(self.missing.values())

    @property
    def missing_share(self) -> float:
        """Share of all counted characters that no font of the chain draws (0 when none counted)."""
        return self.total_missing / self.total_characters if self.total_characters else 0.0

    def missing_share_of(self, script: str) -> float:
        counted = self.characters.get(script, 0)
        return self.missing.get(script, 0) / counted if counted else 0.0

    def as_dict(self) -> dict:
        """JSON-ready: per-script counts and missing shares, plus the totals (for a cache manifest)."""
        return {"characters": dict(self.characters), "missing": dict(self.missing),
                "missing_share": {s: round(self.missing_share_of(s), 6) for s in self.characters},
                "total_characters": self.total_characters, "total_missing": self.total_missing,
                "total_missing_share": round(self.missing_share, 6)}

    def __str__(self) -> str:
        rows = [f"{s:<11}{n:>10,}{self.missing.get(s, 0):>9,}  {self.missing_share_of(s):7.2%}"
                for s, n in self.characters.items()]
        return "\n".join([f"{'script':<11}{'chars':>10}{'missing':>9}  {'share':>7}", *rows,
                          f"{'total':<11}{self.total_characters:>10,}{self.total_missing:>9,}  "
                          f"{self.missing_share:7.2%}"])


def render_params(size: int = 224, font_size: int | None = None, margin: int | None = None, *,
                  layout: str | None = None, cjk_font: str | None = None) -> RenderParams:
    """The renderer's parameters for an image size; font and margin scale with it by default.

    `layout`: "raqm" (shaping, the default where Pillow has libraqm) or "basic". `cjk_font`: a font
    file name or path, with `#face` for a collection, to use instead of the shipped CJK subset
    (default: the NBLIB_CJK_FONT environment variable), e.g. "NotoSansCJK-Regular.ttc#2".
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise ConfigError(f"image size={size!r} is too small to draw text; use an integer >= 8")
    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} is not a layout engine; use one of {', '.join(LAYOUTS)}")
    return RenderParams(size=size,
                        font_size=font_size if font_size is not None else max(8, size // 16),
                        margin=margin if margin is not None else max(1, size // 56),
                        layout=layout or "", fonts=font_chain(cjk_font))


def render_text(text: str, size: int = 224, font_size: int | None = None,
                margin: int | None = None) -> np.ndarray:
    """Draw `text` into a uint8 [size, size, 3] image (deterministic, wrapped, truncated)."""
    return render_with(text, render_params(size, font_size, margin))


def render_with(text: str, params: RenderParams) -> np.ndarray:
    """Draw `text` with fixed `params` into a uint8 [size, size, 3] image (RenderFailed if it cannot)."""
    from PIL import Image, ImageDraw

    image = Image.new("L", (params.size, params.size), BACKGROUND)
    cleaned = clean_text(text)
    chain = _chain(params)
    try:
        lines = _wrap(cleaned, params)
        draw = ImageDraw.Draw(image)
        step = _line_height(params)
        for row, (line, rtl) in enumerate(lines):
            _draw_line(draw, chain, line, rtl, params.margin + row * step + chain.ascent, params)
    except (OSError, RuntimeError, ValueError, OverflowError) as exc:  # the layout engine's own errors
        raise RenderFailed(f"the {params.layout} layout could not draw the text {cleaned[:60]!r}"
                           f"{'...' if len(cleaned) > 60 else ''} ({type(exc).__name__}: {exc}); "
                           f"edit that text, or report it with the text attached") from None
    return np.array(image.convert("RGB"), dtype=np.uint8)


class RenderFailed(InputError):
    """A text the layout engine cannot draw, after cleaning; the message names the text.

    `index`: the text's position in its source when the caller knows it (a cache names the line).
    """

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index

    def __reduce__(self):  # crosses a process pool with its index
        return type(self), (self.args[0], self.index)


def clean_text(text: str) -> str:
    """Strip control characters, NUL and lone surrogates; tabs become spaces; CR, CRLF, U+2028, U+2029 newlines."""
    if not isinstance(text, str):
        raise InputError(f"render_text needs a str, got {type(text).__name__}: {text!r:.80}")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _SURROGATES.sub("", text.translate(_CONTROL_TABLE))


def max_lines_for(params: RenderParams) -> int:
    """How many text lines fit the image height."""
    usable = params.size - 2 * params.margin
    return max(1, (usable - _chain(params).ascent) // _line_height(params) + 1)


def coverage(texts, params: RenderParams | None = None) -> Coverage:
    """Per script, how many characters of `texts` no font of the chain has a glyph for.

    Counts letters, marks, digits and symbols after `clean_text`; spaces, punctuation and format
    characters are ignored. Scripts come from code-point ranges (SCRIPTS; emoji fall in "other").
    """
    covered = _covered_code_points((params or render_params()).fonts)
    characters = dict.fromkeys(SCRIPTS, 0)
    missing = dict.fromkeys(SCRIPTS, 0)
    for text in texts:
        for char in clean_text(text):
            if unicodedata.category(char)[0] not in "ZPC":    # spaces, punctuation, format characters: not counted
                script = script_of(char)
                characters[script] += 1
                missing[script] += ord(char) not in covered
    return Coverage(characters={s: n for s, n in characters.items() if n},
                    missing={s: n for s, n in missing.items() if characters[s]})


def has_glyph(char: str, params: RenderParams | None = None) -> bool:
    """True when a font of the chain draws `char` (spaces and controls count as drawn)."""
    return not char.isprintable() or char.isspace() or \
        ord(char) in _covered_code_points((params or render_params()).fonts)


def script_of(char: str) -> str:
    """The SCRIPTS name of one character, from code-point ranges ("other" outside them)."""
    point = ord(char)
    i = bisect.bisect_right(_RANGE_STARTS, point) - 1
    if i >= 0:
        first, last, script = _SCRIPT_RANGES[i]
        if first <= point <= last:
            return script
    return "other"


def font_chain(cjk_font: str | None = None) -> tuple[FontFile, ...]:
    """The fonts in fallback order with their sha256: the shipped ones, the CJK slot maybe a system font."""
    cjk_font = cjk_font if cjk_font is not None else os.environ.get(CJK_FONT_ENV) or None
    chain = [FontFile(name, 0, _sha256(FONTS_DIR / name)) for name in SHIPPED_FONTS[:-1]]
    if cjk_font:
        path, index = find_font(cjk_font)
        chain.append(FontFile(str(path), index, _sha256(path)))
    else:
        chain.append(FontFile(SHIPPED_FONTS[-1], 0, _sha256(FONTS_DIR / SHIPPED_FONTS[-1])))
    return tuple(chain)


def find_font(spec: str) -> tuple[Path, int]:
    """A font file and face index from "name-or-path[#face]": a path, else searched in SYSTEM_FONT_DIRS."""
    name, _, face = spec.partition("#")
    if face and not face.isdigit():
        raise ConfigError(f"font {spec!r}: the face after '#' must be a number, e.g. NotoSansCJK-Regular.ttc#2")
    path = Path(name).expanduser()
    if not path.is_file():
        path = next((hit for root in SYSTEM_FONT_DIRS if Path(root).expanduser().is_dir()
                     for hit in sorted(Path(root).expanduser().rglob(path.name)) if hit.is_file()), None)
    if path is None:
        raise ConfigError(f"font {name!r} ({CJK_FONT_ENV} or cjk_font=) is neither a file nor found under "
                          f"{', '.join(SYSTEM_FONT_DIRS)}; install it (Debian/Colab: apt-get install "
                          f"fonts-noto-cjk) or unset {CJK_FONT_ENV} to use the shipped subset")
    return path.resolve(), int(face or 0)


@functools.lru_cache(maxsize=1)
def default_layout() -> str:
    """The layout engine: raqm where Pillow has libraqm (shaping, bidi), else basic with a warning."""
    from PIL import features

    if features.check("raqm"):
        return "raqm"
    warnings.warn("Pillow has no libraqm here: Arabic will not join, right-to-left text runs left to right "
                  "and Indic/Thai marks will not combine; images say layout='basic' in their params. "
                  "Fix: apt-get install libraqm0 libfribidi0 (Colab too), then restart the runtime",
                  RuntimeWarning, stacklevel=2)
    return "basic"


# ---------------------------------------------------------------------------------- helpers


class _Chain:
    """The loaded fonts of one RenderParams: which font draws each character, and shaped widths."""

    def __init__(self, params: RenderParams):
        from PIL import ImageFont

        if params.layout not in LAYOUTS:
                raise ConfigError(f"render params name layout={params.layout!r}; use one of {', '.join(LAYOUTS)}")
        if params.layout == "raqm" and default_layout() != "raqm":
                raise ConfigError("these render params need layout='raqm' but Pillow has no libraqm here; install "
                              "libraqm0 and libfribidi0 (apt-get) or render with layout='basic' (other pixels)")
        engine = ImageFont.Layout.RAQM if params.layout == "raqm" else ImageFont.Layout.BASIC
        self.raqm = params.layout == "raqm"
        self.fonts = [ImageFont.truetype(str(_checked_path(f)), params.font_size, index=f.index,
                                         layout_engine=engine) for f in params.fonts]
        self.cmaps = [_cmap(_checked_path(f), f.index) for f in params.fonts]
        self.ascent, self.descent = self.fonts[0].getmetrics()
        self.space = self.fonts[0].getlength(" ")
        self.narrowest = max(1, int(min(self.fonts[0].getlength(chr(c)) for c in range(0x21, 0x7F))))
        self._first = {}   # char -> index of the first font with a glyph, None when none has one
        self._widths = {}  # word -> shaped width

    def font_of(self, char: str) -> int | None:
        index = self._first.get(char, -1)
        if index == -1:
            point = ord(char)
            index = self._first[char] = next((i for i, cmap in enumerate(self.cmaps) if point in cmap), None)
        return index

    def runs(self, text: str) -> list[tuple[int, str]]:
        """Split into (font index, substring): marks and joiners stay with their base when its font has them."""
        runs: list[tuple[int, str]] = []
        start, current = 0, 0
        for i, char in enumerate(text):
            if char in self._first and self._first[char] == current:
                continue
            if _is_attached(char) and ord(char) in self.cmaps[current]:
                continue
            index = self.font_of(char)
            if index is None:
                index = current  # no glyph anywhere: the current font draws its missing-glyph box
            if index != current:
                if i > start:
                    runs.append((current, text[start:i]))
                start, current = i, index
        if len(text) > start:
            runs.append((current, text[start:]))
        return runs

    def width(self, word: str) -> float:
        """Shaped width of a word (cached; the cache is dropped when it grows past 100,000 words)."""
        width = self._widths.get(word)
        if width is None:
            if len(self._widths) > 100_000:
                self._widths.clear()
            width = self._widths[word] = self.measure(word)
        return width

    def measure(self, text: str) -> float:
        return sum(self.fonts[index].getlength(run) for index, run in self.runs(text))

    def fitting_prefix(self, word: str, width: float) -> int:
        """Length of the longest prefix of `word` within `width`, cut between clusters (at least one)."""
        cuts = [i for i in range(1, len(word)) if _can_break_before(word, i)] + [len(word)]
        estimate, total = 0, 0.0
        for i, char in enumerate(word):  # isolated advances guess the cut; shaped widths decide it
            total += 0.0 if unicodedata.category(char)[0] == "M" else self.width(char)
            if total > width:
                break
            estimate = i + 1
        k = max(0, bisect.bisect_right(cuts, estimate) - 1)
        while k > 0 and self.measure(word[:cuts[k]]) > width:
            k -= 1
        while k + 1 < len(cuts) and self.measure(word[:cuts[k + 1]]) <= width:
            k += 1
        return cuts[k]


@functools.lru_cache(maxsize=16)
def _chain(params: RenderParams) -> _Chain:
    return _Chain(params)


def _wrap(text: str, params: RenderParams) -> list[tuple[str, bool]]:
    """The lines that fit, each with its paragraph's direction (True: right to left): a greedy word wrap on the
    shaped widths of whole words (cached per word), so linear in the text; a word wider than the line is broken
    between grapheme clusters; what does not fit is dropped.
    """
    chain = _chain(params)
    width = params.size - 2 * params.margin
    max_lines = max_lines_for(params)
    text = text[: 2 * max_lines * (width // chain.narrowest + 1)]  # x2: marks draw with no advance
    lines: list[tuple[str, bool]] = []
    for paragraph in text.split("\n"):
        rtl = _is_rtl(paragraph)
        line, line_width = "", 0.0
        for word in paragraph.split(" "):
            word_width = chain.width(word)
            if not line and word_width <= width:
                line, line_width = word, word_width
                continue
            if line and line_width + chain.space + word_width <= width:
                line, line_width = f"{line} {word}", line_width + chain.space + word_width
                continue
            if line:
                lines.append((line, rtl))
            while len(lines) < max_lines and word_width > width:
                cut = chain.fitting_prefix(word, width)
                lines.append((word[:cut], rtl))
                word = word[cut:]
                word_width = chain.width(word)
            line, line_width = word, word_width
            if len(lines) >= max_lines:
                return lines[:max_lines]
        lines.append((line, rtl))
        if len(lines) >= max_lines:
            break
    while lines and not lines[-1][0].strip():
        lines.pop()
    return lines[:max_lines]


def _draw_line(draw, chain: _Chain, line: str, rtl: bool, baseline: int, params: RenderParams) -> None:
    """Draw one line's font runs at a baseline: from the left margin, or from the right one when rtl."""
    runs = chain.runs(line)
    direction = {"direction": "rtl" if rtl else "ltr"} if chain.raqm else {}
    x = params.size - params.margin if rtl else params.margin
    for n, (index, run) in enumerate(runs):
        font = chain.fonts[index]
        if run.strip():
            draw.text((x, baseline), run, font=font, fill=INK, anchor="rs" if rtl else "ls", **direction)
        if n + 1 < len(runs):
            x += -font.getlength(run) if rtl else font.getlength(run)


def _line_height(params: RenderParams) -> int:
    chain = _chain(params)
    return chain.ascent + chain.descent + params.line_spacing


def _is_rtl(paragraph: str) -> bool:
    """Whether the first strong character is right-to-left (Hebrew, Arabic), as the bidi algorithm's P2."""
    for char in paragraph:
        kind = unicodedata.bidirectional(char)
        if kind in ("R", "AL"):
            return True
        if kind == "L":
            return False
    return False


def _is_attached(char: str) -> bool:
    """A combining mark, joiner, variation selector or emoji modifier: part of the cluster before it."""
    return char in _JOINERS or unicodedata.category(char)[0] == "M"


def _can_break_before(word: str, i: int) -> bool:
    """A line may break before word[i]: not inside a cluster, not after a joiner or a virama."""
    before = word[i - 1]
    return not (_is_attached(word[i]) or before == "\u200d" or unicodedata.combining(before) == 9)


def _checked_path(font: FontFile) -> Path:
    """The font's file, checked once per process against the sha256 the params recorded."""
    path = Path(font.file) if os.path.isabs(font.file) else FONTS_DIR / font.file
    if not path.is_file():
        raise ConfigError(f"font file {path} is missing; restore data/fonts/ from the repository, or install "
                          f"the font the render params name (Debian/Colab: apt-get install fonts-noto-cjk)")
    actual = _sha256(path)
    if actual != font.sha256:
        raise ConfigError(f"font file {path} has sha256 {actual[:12]}, the render params expect "
                          f"{font.sha256[:12]}: images would not match; use the font the params were made "
                          f"with, or rebuild with render_params() (a new cache)")
    return path


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


@functools.lru_cache(maxsize=16)
def _cmap(path: Path, index: int) -> frozenset[int]:
    """Code points the font face maps to a glyph (fontTools, a matplotlib dependency; read once)."""
    from fontTools.ttLib import TTFont

    collection = path.suffix.lower() in (".ttc", ".otc")
    with TTFont(str(path), fontNumber=index if collection else -1, lazy=True) as font:
        return frozenset(font.getBestCmap())


def _covered_code_points(fonts: tuple[FontFile, ...]) -> frozenset[int]:
    return frozenset().union(*(_cmap(_checked_path(f), f.index) for f in fonts))
