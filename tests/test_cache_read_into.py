"""The in-order read decodes each image straight into its row of the batch: same bytes, no copy per image.

`get_batch` over batches that cross shards, end in a partial batch or start at an offset gives
the images written, byte for byte, and the same bytes as reading each image alone, for every
codec; a zstd batch allocates nothing per image beyond the batch itself (no bytes object per
decompressed image); a frame that decodes to another size than its row is refused.
"""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from nblib.cache import ShardedImageCache, write_images
from nblib.cache.codecs import CodecSpec, codec_for, encode_image
from nblib.errors import CacheError

N, SIDE = 23, 24
SHARD_MB = 0.006  # a few images of 24 px per shard: batches cross shard edges


def images(n: int = N, side: int = SIDE, seed: int = 0) -> np.ndarray:
    """Blocky random images (they compress, as real ones do) with some noise on top."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, side // 4, side // 4, 3), dtype=np.uint8)
    noise = rng.integers(0, 8, (n, side, side, 3), dtype=np.uint8)
    return blocks.repeat(4, axis=1).repeat(4, axis=2) + noise


@pytest.fixture(scope="module", params=["raw", "zstd", "zlib"])
def written(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"read-into-{request.param}")
    source = images()
    write_images(list(source), folder, shard_mb=SHARD_MB, codec=request.param, progress=False)
    return folder, source


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("batch", [4, 7, N])
def test_batches_from_an_offset_with_a_partial_last_batch_are_the_images_written(written, start, batch):
    folder, source = written
    cache = ShardedImageCache(folder)
    assert len(cache.manifest["shards"]) > 2
    alone = np.stack([cache[i] for i in range(N)])
    assert np.array_equal(alone, source)
    for first in range(start, N, batch):
        got = cache.get_batch(first, min(N, first + batch))
        assert got.flags.writeable and got.flags.c_contiguous
        assert got.tobytes() == alone[first:first + batch].tobytes()
    assert np.array_equal(np.concatenate(list(cache.iter_shards())), source)


@pytest.mark.parametrize("check", ["image", "off"])
def test_a_zstd_batch_allocates_no_bytes_object_per_image(tmp_path, check):
    source = images(n=12, side=128)
    write_images(list(source), tmp_path, shard_mb=400, codec="zstd", progress=False)
    cache = ShardedImageCache(tmp_path, check=check)
    cache.get_batch(0, 1)  # shard mapped, codec contexts built, before tracing starts
    tracemalloc.start()
    try:
        batch = cache.get_batch(0, 12)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(batch, source)
    image_bytes = source[0].nbytes
    assert peak - batch.nbytes < image_bytes // 2, (peak, batch.nbytes, image_bytes)


def test_a_zstd_frame_of_another_size_than_its_row_is_refused():
    coder = codec_for(CodecSpec("zstd", 3))
    small, big = images(n=1, side=8)[0], images(n=1, side=12)[0]
    for blob, why in ((encode_image(big, "zstd"), "more than"), (encode_image(small[:4], "zstd"), "decodes to")):
        row = memoryview(bytearray(small.nbytes))
        with pytest.raises(ValueError, match=why):
            coder.decode_into(blob, small.shape, row)
    with pytest.raises(ValueError, match="do not decode"):
        coder.decode_into(b"not a zstd frame", small.shape, memoryview(bytearray(small.nbytes)))


def test_a_damaged_zstd_frame_read_unchecked_is_refused_naming_the_image(tmp_path):
    source = images(n=6, side=32)
    write_images(list(source), tmp_path, shard_mb=400, codec="zstd", progress=False)
    shard = tmp_path / ShardedImageCache(tmp_path).manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    cache = ShardedImageCache(tmp_path, check="off")
    _, offsets, base, _ = cache._handle(0)
    at = base + int(offsets[3])
    data[at:at + 4] = b"\0\0\0\0"  # image 3's frame magic
    cache.close()
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its stat kept: opening does not hash it
    with pytest.raises(CacheError, match=r"image 3 .*zstd bytes do not decode"):
        ShardedImageCache(tmp_path, check="off").get_batch(0, 6)


def test_after_a_zstd_read_the_shard_map_closes(tmp_path):
    """Frames are read through views of the shard's map; none outlives the read, so close() unmaps it."""
    write_images(list(images(n=5)), tmp_path, shard_mb=400, codec="zstd", progress=False)
    cache = ShardedImageCache(tmp_path)
    cache.get_batch(0, 5)
    mapped = cache._handle(0)[0]
    cache.close()
    assert mapped.closed
