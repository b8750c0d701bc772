"""Record shards of token ids as what an encode run reads (`encode --records DIR --input-key FIELD --model SPEC`).

Each record's integer field is one text's token ids. A batch is the ids zero-padded to one length and their
attention mask, packed as int64 [n, 2, LENGTH] (`get_batch`), which `EncodeModel` calls a text encoder with
(`input_ids`, `attention_mask`: nblib.budget.traced_jobs.batch_input, as the budget traces it). The length is
the shards' longest record unless given; a shorter one is refused, so no token is cut. Trade-off: every batch is
padded to that one length (fixed output shapes per sample, as the parts need), so a folder of short texts with
one long one pays the long one's attention in every batch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nblib.atomic import sha256_json
from nblib.errors import ConfigError


class TokenRecords:
    """Record shards read as padded token ids and masks (see the module docstring); an encode source."""

    complete = True                     # RecordShards refuses a folder that is not

    def __init__(self, folder: str | Path, field: str, length: int | None = None):
        from nblib.cache.record_reader import RecordShards

        self.folder, self.field = Path(folder), field
        shards = RecordShards(self.folder)
        schema, entries = shards.manifest["fields"], shards.manifest["shards"]
        self._count = len(shards)
        shards.close()
        kind = schema.get(field)
        if kind is None:
            raise ConfigError(f"--input-key {field!r} is not a field of the records in {self.folder}; their fields "
                              f"are {list(schema)}")
        if kind["kind"] != "array" or kind["ndim"] != 1 or np.dtype(kind["dtype"]).kind not in "iu":
            raise ConfigError(f"--input-key {field!r} holds {kind.get('dtype', 'scalars')} of {kind.get('ndim', 0)} "
                              f"dims; encode --records reads token ids: one 1-D integer array per record")
        longest = max((int(s["max_shapes"][field][0]) for s in entries if field in s.get("max_shapes", {})),
                      default=0)
        if length is not None and length < longest:
            raise ConfigError(f"--input tokens:{length} is shorter than the longest record of {self.folder} "
                              f"({longest:,} tokens): nothing is cut; give tokens:{longest} or more, or leave the "
                              f"length out")
        self.length = max(length or longest, 1)
        self.inputs = f"tokens:{self.length}"
        self.fingerprint = sha256_json({"records": [[s["file"], s["sha256"], s["count"]] for s in entries],
                                        "field": field, "length": self.length})
        self._shards = None

    image_size = 0                      # no images: EncodeModel checks none

    def __len__(self) -> int:
        return self._count

    def get_batch(self, start: int, stop: int) -> np.ndarray:
        """Records [start, stop) as int64 [n, 2, length]: the ids zero-padded, then 1 on each real token."""
        from nblib.cache.record_reader import RecordShards

        if self._shards is None:         # one reader per process (loader workers open their own)
            self._shards = RecordShards(self.folder)
        batch = np.zeros((stop - start, 2, self.length), dtype=np.int64)
        for row, index in enumerate(range(start, stop)):
            ids = np.asarray(self._shards[index][self.field])
            batch[row, 0, :len(ids)], batch[row, 1, :len(ids)] = ids, 1
        return batch

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_shards": None}
