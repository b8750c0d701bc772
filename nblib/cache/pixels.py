"""The one pixel policy: how every image nblib decodes becomes a uint8 [H, W, 3] array.

Every source goes through `pil_pixels` (a folder, Parquet, an HF datasets folder read undecoded,
webdataset tars, the PIL images handed to `write_images`); the five steps (bomb refusal, JPEG draft
for `--size`, EXIF orientation, RGB, resize) and why: docs/formats.md, "The pixel policy of images
in". Each Pillow warning (a corrupt EXIF, an image over the pixel limit) is one log line naming the
image, not a Python warning.
"""
from __future__ import annotations

import contextlib
import io
import logging
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nblib.errors import ConfigError, InputError

log = logging.getLogger(__name__)

SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
RESIZE_POLICY = "the shorter side scaled to N (Pillow bicubic, antialiased), then the centre N x N crop"
DRAFT_POLICY = ("a JPEG decoded at the smallest of 1/1, 1/2, 1/4, 1/8 scale whose shorter side is still >= N "
                "(Image.draft), then resized")
ORIENTATION_POLICY = "EXIF orientation applied as PIL.ImageOps.exif_transpose does"
DECODE_POLICY = f"{DRAFT_POLICY}; {ORIENTATION_POLICY}"     # a --size cache's manifest records it
MAX_SIZE = 16_384           # --size: 805 MB per image at uint8 RGB; past it one image outgrows a Colab's RAM
RESIZE_RAM_CHECK = 1 << 30  # a resize's intermediate past this many bytes is checked against the free RAM


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image file's bytes, not yet decoded, and where they came from (a path, a row, a tar member):
    decoded by `decode_image_bytes` when `write_images` knows its `size` (so a JPEG can be drafted).
    """
    data: bytes
    where: str
    mode: str | None = None     # a `datasets.Image(mode=...)` column's mode, converted to as datasets does


def check_size(size: int | None, flag: str = "--size") -> int | None:
    """`size` when it is None or 1..MAX_SIZE; else ConfigError, before anything is allocated."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{flag} {size!r} is no image size; pass a whole number of pixels, 1..{MAX_SIZE:,}")
    if size > MAX_SIZE:
        raise ConfigError(f"{flag} {size:,} is over {MAX_SIZE:,} px, the largest nblib resizes to (one "
                          f"{size:,} x {size:,} RGB image is {3 * size * size / 1e9:,.1f} GB of RAM); pass "
                          f"{flag} {MAX_SIZE} or less")
    return size


def decode_image_bytes(data: bytes, where: str, size: int | None = None, mode: str | None = None) -> np.ndarray:
    """Encoded image bytes as uint8 [H, W, 3] by the pixel policy (`pil_pixels`, drafted for `size`);
    InputError naming `where` for a file Pillow cannot read or one over its decompression-bomb limit.
    """
    from PIL import Image

    try:
        with _pillow_warnings_logged(where), Image.open(io.BytesIO(data)) as image:
            return pil_pixels(image, where, size, mode)
    except Image.DecompressionBombError as exc:
        raise InputError(f"{where} is refused as a decompression bomb: over Pillow's limit of "
                         f"{2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels ({exc}); shrink it, or raise "
                         f"PIL.Image.MAX_IMAGE_PIXELS if you trust the file") from None
    except OSError as exc:
        raise InputError(f"{where} is not an image Pillow can read ({exc}); remove it or fix it") from None


def pil_pixels(image, where: str, size: int | None = None, mode: str | None = None) -> np.ndarray:
    """A PIL image as uint8 [H, W, 3] by the one pixel policy (module docstring): drafted for `size`
    (a JPEG not yet loaded), EXIF orientation applied as `ImageOps.exif_transpose`, converted to `mode`
    first where a `datasets.Image(mode=...)` column asks, then `pil_rgb`. Not resized: `fit_size` does
    that, after.
    """
    from PIL import ImageOps

    if size and getattr(image, "format", None) == "JPEG":
        image.draft("RGB", (size, size))        # a no-op once loaded, or for a progressive multi-tile file
    try:
        with _pillow_warnings_logged(where):
            ImageOps.exif_transpose(image, in_place=True)   # a no-op without an orientation other than 1
    except (ValueError, SyntaxError, TypeError, KeyError, IndexError, struct.error) as exc:
        raise InputError(f"{where} has EXIF data Pillow cannot parse ({type(exc).__name__}: {exc}); "
                         f"strip it (e.g. exiftool -all= FILE) or re-save the image, then rerun") from None
    if mode and image.mode != mode:
        image = image.convert(mode)
    return pil_rgb(image, where)


def pil_rgb(image, where: str) -> np.ndarray:
    """A PIL image as uint8 [H, W, 3]. 16-bit grey (I;16, and I holding 0..65535) is scaled to 8 bit
    (v * 255 / 65535, rounded), not clipped as `convert("RGB")` clips it; float images are refused.
    """
    if image.mode in SIXTEEN_BIT_MODES:
        array = np.asarray(image).astype(np.int64)
        if array.size and (array.min() < 0 or array.max() > 65535):
            raise InputError(f"{where} is a 32-bit integer image (mode {image.mode}) with values "
                             f"{array.min()}..{array.max()}, outside 16 bits; convert it to 8 bit first")
        grey = ((array * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode == "F":
        raise InputError(f"{where} is a floating-point image (mode F): its range is unknown; convert it "
                         f"to 8 bit first (e.g. scale to 0..255 and save as PNG)")
    return np.asarray(image.convert("RGB"))


def fit_size(image: np.ndarray, size: int | None, where: str = "an image") -> np.ndarray:
    """`image` resized by RESIZE_POLICY to N = `size` (None, or N x N already: as it is). A resize
    whose intermediate (shorter side N, the longer one scaled alike) outgrows the free RAM is refused.
    """
    height, width = image.shape[:2]
    if size is None or (height, width) == (size, size):
        return image
    from PIL import Image

    scale = size / min(height, width)
    new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
    nbytes = new_h * new_w * 3
    if nbytes >= RESIZE_RAM_CHECK:
        import psutil

        available = psutil.virtual_memory().available
        if 2 * nbytes > available:                  # Pillow's resize holds its two passes' images
            raise InputError(f"{where} ({width}x{height} px) resized to --size {size:,} is {new_w:,}x{new_h:,} px "
                             f"before its centre crop, {2 * nbytes / 1e9:,.1f} GB to resize, over the "
                             f"{available / 1e9:,.1f} GB of RAM free; pass a smaller --size, or crop that image first")
    resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.Resampling.BICUBIC))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return np.ascontiguousarray(resized[top:top + size, left:left + size])


@contextlib.contextmanager
def _pillow_warnings_logged(where: str):
    """Within it, each warning Pillow issues (DecompressionBombWarning for an image between
    MAX_IMAGE_PIXELS and twice it, "Corrupt EXIF data", ...) becomes one log line naming `where`,
    not a two-line Python warning; any other warning is issued as it came.
    """
    from PIL import Image

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        yield
    for warning in caught:
        if issubclass(warning.category, Image.DecompressionBombWarning):
            log.warning("%s: %s; decoded anyway, as it is under twice that limit (raise "
                        "PIL.Image.MAX_IMAGE_PIXELS to trust such files silently)", where, warning.message)
        elif "PIL" in Path(warning.filename).parts:
            log.warning("%s: %s (Pillow); decoded as Pillow reads it", where, str(warning.message).strip())
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
