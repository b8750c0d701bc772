"""Sharded image cache: render texts once into a few large shards; write resumably, verify, read.

Parts: `codecs` (the codec registry `CODECS`), `format` (the shard files, `ShardWriter`, the
manifest, the local stat cache), `texts` (what is rendered), `populate` (render into shards,
resumably), `images` (`write_images`: your own arrays in), `sources` (a folder, a saved HF dataset, Parquet,
Arrow, webdataset tars, with labels or texts in a side table), `verify` (check and repair), `reader`
(`ShardedImageCache`, `CacheDataset`). Record shards (records of tensors, grouped by a key):
`records` (`write_records`), `record_format`, `record_sources` (any pickle, .npz, .pt; pickles read by
`pickle_stream` one record at a time through the allow-list of `pickle_globals`),
`record_reader` (`RecordShards`, `RecordShardShuffle`) and `record_torch` (torch datasets; imports
torch, so it is not re-exported here); `verify` checks both kinds of folder into one `VerifyReport`.
The measurements and demos of notebook 02 live in `nblib.lab.cache_population`; the command line is
`python -m nblib cache` (`nblib.cli`).
"""
from __future__ import annotations

from nblib.cache.codecs import CODECS, encode_image
from nblib.cache.format import STAT_CACHE, measure_codecs, read_cache_manifest, write_shard
from nblib.cache.images import write_images
from nblib.cache.populate import plan_cache, populate
from nblib.cache.reader import CacheDataset, ShardedImageCache
from nblib.cache.record_reader import RecordShards, RecordShardShuffle
from nblib.cache.record_sources import record_source
from nblib.cache.records import write_records
from nblib.cache.texts import read_texts, sample_texts, sample_texts_path
from nblib.cache.verify import verify, verify_records

__all__ = [
    "CODECS", "STAT_CACHE", "CacheDataset", "ShardedImageCache", "encode_image", "measure_codecs",
    "plan_cache", "populate", "read_cache_manifest", "read_texts", "sample_texts",
    "sample_texts_path", "verify", "write_images", "write_shard", "RecordShardShuffle",
    "RecordShards", "record_source", "verify_records", "write_records",
]
