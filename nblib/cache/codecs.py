"""The cache's codec registry: how one uint8 [H, W, 3] image becomes stored bytes, and back.

`CODECS` maps a name to a `Codec` (its shard suffix and a level range; the bytes each codec is
assumed to store before a sample is measured are the budget's: nblib.budget.CODEC_RATIO_ESTIMATE,
the same names, which tests/test_cache_checks.py holds equal). `CodecSpec` is one cache's
choice (name, level, zstd dictionary): what the manifest records and `codec_for` turns into an
encoder/decoder. Trade-offs, measured on the sample texts (benchmarks/cache_throughput.py):
raw costs H*W*3 bytes and no decode; zlib (deflate, level 1) is ~30x smaller on text images;
png adds row filters, a little smaller and slower; zstd (level 3) with a 16 KB dictionary trained
on the first shard's images is ~45% smaller than zlib and decodes ~3x faster. A dictionary is
kept only when it pays (DICT_MIN_GAIN on held-out images of the sample).
"""
from __future__ import annotations

import base64
import functools
import io
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nblib.errors import ConfigError

ZLIB_LEVEL = 1          # level 1 stores text images within a few % of level 6 and writes faster
PNG_LEVEL = 1
ZSTD_LEVEL = 3          # zstd's own default; 9 is ~20% smaller and ~6x slower to write
DICT_BYTES = 16_384     # zstd dictionary size: larger ones came out no better on 150-256 samples
DICT_SAMPLES = 256      # images of the first shard a dictionary is trained and judged on
DICT_MIN_GAIN = 0.05    # keep the dictionary only when held-out images shrink by at least this share


@dataclass(frozen=True)
class Codec:
    """One entry of the registry: a stored format for images."""

    name: str
    suffix: str                     # shard file suffix
    levels: tuple[int, int] | None  # allowed compression levels, None when there is no knob
    default_level: int | None
    note: str

    def level(self, level: int | None) -> int | None:
        """The level to use (the default for None); ConfigError outside the codec's range."""
        if self.levels is None:
            if level is not None:
                raise ConfigError(f"codec {self.name!r} has no level; drop codec_level (--codec-level)")
            return None
        if level is None:
            return self.default_level
        lo, hi = self.levels
        if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
            raise ConfigError(f"codec_level={level!r} is out of range for {self.name}: pick an integer "
                              f"{lo}..{hi} (default {self.default_level})")
        return level


CODECS: dict[str, Codec] = {
    "raw": Codec("raw", ".npy", None, None, "uint8 [n, H, W, 3] .npy, memory-mapped, no decode"),
    "png": Codec("png", ".pngs", (0, 9), PNG_LEVEL, "PNG per image (Pillow), row filters + deflate"),
    "zlib": Codec("zlib", ".zlib", (0, 9), ZLIB_LEVEL, "deflate over raw pixel rows"),
    "zstd": Codec("zstd", ".zst", (1, 22), ZSTD_LEVEL,
                  "zstandard, with a dictionary trained on the first shard when it pays"),
}


@dataclass(frozen=True)
class CodecSpec:
    """One cache's codec: name, level and (zstd) dictionary bytes; hashable and picklable."""

    name: str
    level: int | None = None
    dictionary: bytes | None = None

    def record(self) -> dict:
        """What the manifest stores (JSON types: the dictionary as base64)."""
        out = {"level": self.level}
        if self.dictionary is not None:
            out["dictionary"] = base64.b64encode(self.dictionary).decode()
        return out

    @classmethod
    def from_record(cls, name: str, record: dict | None) -> CodecSpec:
        """The spec a manifest recorded (`record` is its "codec_options")."""
        record = record or {}
        dictionary = record.get("dictionary")
        return cls(name, record.get("level"), base64.b64decode(dictionary) if dictionary else None)


def check_codec(codec: str) -> Codec:
    """The registry entry of `codec`; ConfigError naming the choices otherwise."""
    if codec not in CODECS:
        raise ConfigError(f"codec={codec!r} is not supported; choose one of {tuple(CODECS)} (or 'auto')")
    return CODECS[codec]


def codec_spec(codec: str | CodecSpec, level: int | None = None) -> CodecSpec:
    """A CodecSpec from a name (and level), checked against the registry."""
    if isinstance(codec, CodecSpec):
        return codec
    entry = check_codec(codec)
    return CodecSpec(codec, entry.level(level))


@functools.lru_cache(maxsize=16)
def codec_for(spec: CodecSpec) -> ImageCodec:
    """The encoder/decoder of a spec (cached per process: zstd contexts are built once)."""
    check_codec(spec.name)
    return ImageCodec(spec)


class ImageCodec:
    """Encode and decode images under one CodecSpec."""

    def __init__(self, spec: CodecSpec):
        self.spec = spec
        self._zstd = None

    def encode(self, image: np.ndarray) -> bytes:
        """The stored bytes of one uint8 [H, W, 3] image."""
        name, data = self.spec.name, np.ascontiguousarray(image, dtype=np.uint8)
        if name == "raw":
            return data.tobytes()
        if name == "zlib":
            return zlib.compress(data.tobytes(), self.spec.level)
        if name == "zstd":
            return self._zstd_contexts()[0].compress(data.tobytes())
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(data).save(buffer, format="PNG", compress_level=self.spec.level)
        return buffer.getvalue()

    def decode(self, blob, shape: tuple[int, ...]) -> np.ndarray:
        """One uint8 image of `shape` from its stored bytes; ValueError when they do not decode."""
        name = self.spec.name
        try:
            if name == "raw":
                return np.frombuffer(blob, dtype=np.uint8).reshape(shape)
            if name == "zlib":
                return np.frombuffer(zlib.decompress(blob), dtype=np.uint8).reshape(shape)
            if name == "zstd":
                import zstandard

                try:
                    out = self._zstd_contexts()[1].decompress(blob, max_output_size=math.prod(shape))
                except zstandard.ZstdError as exc:
                    raise ValueError(str(exc)) from None
                return np.frombuffer(out, dtype=np.uint8).reshape(shape)
            from PIL import Image

            with Image.open(io.BytesIO(blob)) as image:
                array = np.asarray(image.convert("RGB"), dtype=np.uint8)
        except (zlib.error, ValueError, OSError, SyntaxError, EOFError, struct.error) as exc:
            raise ValueError(f"its {name} bytes do not decode ({type(exc).__name__}: {exc})") from None
        if array.shape != tuple(shape):
            raise ValueError(f"it decodes to shape {array.shape}, not {tuple(shape)}")
        return array

    def decode_into(self, blob, shape: tuple[int, ...], row: memoryview) -> None:
        """Decode one image's stored bytes into `row`, a writable 1-d byte view of exactly its size.

        zstd decompresses straight into `row` (a stream reader's `readinto` over the frame: no bytes
        object per image, no copy); the other codecs decode, then copy. ValueError when the bytes do
        not decode, or decode to another size than `row`'s.
        """
        if self.spec.name != "zstd":
            np.frombuffer(row, dtype=np.uint8).reshape(shape)[...] = self.decode(blob, shape)
            return
        import zstandard

        try:
            reader = self.zstd_decompressor().stream_reader(blob)
            got = reader.readinto(row)
            more = reader.read(1)  # b"" once the frame is done: a longer frame is not cut to fit
        except zstandard.ZstdError as exc:
            raise ValueError(f"its zstd bytes do not decode ({exc})") from None
        if got != len(row) or more:
            size = f"more than {got:,}" if more else f"{got:,}"
            raise ValueError(f"it decodes to {size} bytes, not {len(row):,}")

    def zstd_decompressor(self):
        """The zstd decompressor of this spec (with its dictionary), built once."""
        return self._zstd_contexts()[1]

    def _zstd_contexts(self):
        if self._zstd is None:
            import zstandard

            kw = {}
            if self.spec.dictionary is not None:
                kw["dict_data"] = zstandard.ZstdCompressionDict(self.spec.dictionary)
            # no content size / checksum in frames: the shard's xxh3 table checks every blob
            self._zstd = (zstandard.ZstdCompressor(level=self.spec.level, write_checksum=False, **kw),
                          zstandard.ZstdDecompressor(**kw))
        return self._zstd


def encode_image(image: np.ndarray, codec: str | CodecSpec) -> bytes:
    """The stored bytes of one uint8 [H, W, 3] image under `codec` (a name: its default level)."""
    return codec_for(codec_spec(codec)).encode(image)


def train_dictionary(images: Sequence[np.ndarray], level: int | None = None) -> tuple[bytes | None, float]:
    """A zstd dictionary trained on the first 3/4 of `images`, and its measured gain.

    The gain is the share of bytes saved on the held-out quarter (never on the images it was
    trained on). Returns (None, gain) when the gain is below DICT_MIN_GAIN or there are too few
    images to train on. Deterministic: the same images give the same dictionary bytes.
    """
    import zstandard

    level = CODECS["zstd"].level(level)
    samples = [np.ascontiguousarray(im, dtype=np.uint8).tobytes() for im in images[:DICT_SAMPLES]]
    held_out, train = samples[3::4], [s for k, s in enumerate(samples) if k % 4 != 3]
    if len(train) < 8 or not held_out:
        return None, 0.0
    try:
        # fixed cover parameters: 4x faster than zstd's parameter search, the same gain on text images
        dictionary = zstandard.train_dictionary(DICT_BYTES, train, k=256, d=8, threads=0).as_bytes()
    except zstandard.ZstdError:
        return None, 0.0  # too little variety to train on
    plain = codec_for(CodecSpec("zstd", level))
    with_dict = codec_for(CodecSpec("zstd", level, dictionary))
    without = sum(len(plain.encode(np.frombuffer(s, np.uint8))) for s in held_out)
    within = sum(len(with_dict.encode(np.frombuffer(s, np.uint8))) for s in held_out)
    gain = 1.0 - within / without
    return (dictionary if gain >= DICT_MIN_GAIN else None), float(gain)
