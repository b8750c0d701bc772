"""Guide-like trace records, made at run time: a small MoE-routing dataset for the tests and benchmarks.

The sharding guide's records are traces of a mixture-of-experts model: per record, the
`hidden_states` [T, H] that enter one layer's router and the router's answer `target_routing`,
plus the `layer_id`. Here record i is step i // layers at layer i % layers (a trace's order:
every layer of one step, then the next step), with T drawn per record (shapes differ), hidden
states normal in float16, and the target a real function of them: the softmax of a fixed random
router per layer ([T, E] float32 probabilities), or its `top_k` expert indices ([T, k] int64), so a
model can learn it. `token_ids` [T] int32 and `step` ride along. Everything is a pure function of
(seed, i): the same call gives the same bytes. Nothing big ships; a 1 GB file is made on demand.
"""
from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nblib.atomic import AtomicWriter
from nblib.errors import ConfigError

VOCAB = 32_000


def trace_records(n_records: int, *, hidden: int = 256, experts: int = 8, layers: int = 4,
                  tokens: tuple[int, int] = (16, 64), top_k: int | None = None, dtype: str = "float16",
                  seed: int = 0, start: int = 0) -> Iterator[dict]:
    """Yield records `start` .. `start + n_records - 1` of a guide-like MoE-routing trace.

    Args:
        n_records: how many records.
        hidden: H, the hidden size.
        experts: E, the number of experts.
        layers: layers per step (record i has layer_id i % layers).
        tokens: (fewest, most) tokens T per record, drawn per record.
        top_k: None: `target_routing` holds the probabilities [T, E]; k: the k best experts [T, k].
        dtype: the hidden states' dtype ("float16" or "float32").
        seed: the trace's seed.
        start: the first record's number (any record can be made alone).
    """
    if not 1 <= tokens[0] <= tokens[1] or hidden < 1 or experts < 1 or layers < 1:
        raise ConfigError(f"tokens={tokens}, hidden={hidden}, experts={experts}, layers={layers}: need "
                          f"1 <= fewest <= most tokens and sizes >= 1")
    if top_k is not None and not 1 <= top_k <= experts:
        raise ConfigError(f"top_k={top_k} must be in [1, experts={experts}]")
    routers = [(np.random.default_rng([seed, 1_000_003, layer]).standard_normal((hidden, experts))
                / np.sqrt(hidden)).astype(np.float32) for layer in range(layers)]
    for i in range(start, start + n_records):
        rng = np.random.default_rng([seed, i])
        n_tokens = int(rng.integers(tokens[0], tokens[1] + 1))
        states = rng.standard_normal((n_tokens, hidden), np.float32)
        logits = states @ routers[i % layers]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        probs = probs.astype(np.float32)
        target = probs if top_k is None else np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)
        yield {"hidden_states": states.astype(dtype), "target_routing": target,
               "layer_id": i % layers, "step": i // layers,
               "token_ids": rng.integers(0, VOCAB, n_tokens, dtype=np.int32)}


def trace_record_bytes(*, hidden: int = 256, experts: int = 8, tokens: tuple[int, int] = (16, 64),
                       top_k: int | None = None, dtype: str = "float16") -> float:
    """The mean array bytes of one record of `trace_records` with these sizes."""
    mean_tokens = (tokens[0] + tokens[1]) / 2
    target = experts * 4 if top_k is None else top_k * 8
    return mean_tokens * (hidden * np.dtype(dtype).itemsize + target + 4)


def write_trace_pickle(path: str | Path, *, n_records: int | None = None, target_bytes: int | None = None,
                       **sizes) -> int:
    """Write a trace as a pickle stream (`pickle.dump` per record); its record count.

    Pass `n_records`, or `target_bytes` to write records until the file reaches that size. The file
    is written atomically. `sizes` go to `trace_records`.
    """
    if (n_records is None) == (target_bytes is None):
        raise ConfigError("write_trace_pickle needs one of n_records or target_bytes")
    if n_records is None:
        shape = {k: v for k, v in sizes.items() if k not in ("layers", "seed", "start")}
        n_records = max(1, int(np.ceil(target_bytes / trace_record_bytes(**shape))))
    with AtomicWriter(path, background_hash=False) as writer:
        for record in trace_records(n_records, **sizes):
            pickle.dump(record, writer, protocol=pickle.HIGHEST_PROTOCOL)
        writer.commit()
    return n_records
