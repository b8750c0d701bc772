"""Render on the fly: an image source that draws each image from its text when asked, with no cache on disk.

`RenderedImages` offers what encode reads from a cache (`len`, `complete`, `image_size`,
`fingerprint`, `get_batch`) and draws with the same renderer params, so image i has the same
bytes as image i of a cache built from the same texts: encoder outputs are byte-identical and a
run resumes as it would from the cache. The texts are held as one UTF-8 buffer plus offsets
(no per-text Python objects, so forked DataLoader workers share the pages instead of copying
them). Trade-off: no disk (287 GB raw or 40 GB PNG for the reference job), but every image costs
a render (~2 ms per core at 224 px) each time it is read; worth it when the loader's workers
render at least as fast as the device encodes.
"""
from __future__ import annotations

import numpy as np

from nblib.atomic import sha256_json
from nblib.cache.populate import recorded_render_params, renderer_record
from nblib.cache.texts import require_texts, scan_texts, text_source
from nblib.errors import CacheError
from nblib.render import RenderParams, render_params, render_with

ENCODING = ("utf-8", "surrogatepass")   # as the source fingerprint encodes texts


class RenderedImages:
    """Texts as an indexable array of uint8 [H, W, 3] images, each rendered when read."""

    def __init__(self, texts, image_size: int = 224, *, field: str | None = None, errors: str = "strict",
                 font_size: int | None = None, params: RenderParams | None = None):
        source = text_source(texts, field, errors)
        scan = scan_texts(source, sample_size=0)
        require_texts(scan, source)
        self.params = params or render_params(image_size, font_size)
        encoded = [t.encode(*ENCODING) for t in source]
        self._offsets = np.cumsum([0, *map(len, encoded)], dtype=np.int64)
        self._blob = b"".join(encoded)
        self._source_sha256 = scan.sha256

    @classmethod
    def like(cls, cache, texts=None) -> RenderedImages:
        """The rendered twin of a ShardedImageCache: its texts (or `texts`), its renderer params.

        CacheError when the cache was built from an in-memory list and no `texts` are given, or
        when the texts are not the ones the cache was rendered from.
        """
        manifest = cache.manifest
        source = manifest["source"]
        if texts is None and source.get("path") is None:
            raise CacheError(f"the cache at {cache.cache_dir} was built from an in-memory list of texts; "
                             f"pass the same texts: RenderedImages.like(cache, texts)")
        twin = cls(source.get("path") if texts is None else texts, field=source.get("field"),
                   errors=source.get("errors", "strict"), params=recorded_render_params(manifest))
        if twin.source_sha256 != source["sha256"]:
            raise CacheError(f"these {len(twin):,} texts are not the {source['n_texts']:,} the cache at "
                             f"{cache.cache_dir} was rendered from (their sha256 differs); pass the same texts")
        return twin

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @property
    def complete(self) -> bool:
        """Always True: every text can be drawn."""
        return True

    @property
    def image_size(self) -> int:
        return int(self.params.size)

    @property
    def source_sha256(self) -> str:
        """The texts' fingerprint, as a cache built from them records it."""
        return self._source_sha256

    @property
    def fingerprint(self) -> str:
        """sha256 over the texts' fingerprint and the renderer params (no codec, no shards)."""
        return sha256_json({"source": self._source_sha256, "renderer": renderer_record(self.params),
                            "rendered": True})

    def text(self, i: int) -> str:
        return self._blob[self._offsets[i]:self._offsets[i + 1]].decode(*ENCODING)

    def get_batch(self, start: int, stop: int) -> np.ndarray:
        """Images [start, stop), rendered now, as one uint8 [n, H, W, 3] array."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"batch [{start}, {stop}) is out of range for {len(self):,} texts")
        out = np.empty((stop - start, self.image_size, self.image_size, 3), dtype=np.uint8)
        for k, i in enumerate(range(start, stop)):
            out[k] = render_with(self.text(i), self.params)
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        i = int(index) + (len(self) if int(index) < 0 else 0)
        return self.get_batch(i, i + 1)[0]

    def __repr__(self) -> str:
        return f"RenderedImages({len(self):,} texts at {self.image_size} px, rendered when read)"
