"""How well an order is shuffled: displacement, rank correlation and same-episode neighbours.

Each metric is a pure function of the order (source indices in output order) and comes with its
value for a uniform random permutation, so a shuffle is judged against "as good as random".
Trade-off: these see position and episode structure only, not every statistical property.
"""
from __future__ import annotations

import numpy as np


def shuffle_quality(order, episode_len: int | None = None) -> dict:
    """Displacement summary, rank correlation and (for episodic sources) same-episode share.

    Reference values for a uniform random permutation of n: mean displacement ~ n/3 (reported
    as `displacement_mean_vs_random`, 1.0 = as good as random), spearman ~ 0 (+-1/sqrt(n)), and
    same-episode share ~ (k-1)/(n-1).
    """
    order = np.asarray(order, dtype=np.int64)
    n = int(order.size)
    moved = displacements(order)
    random_mean = (n * n - 1) / (3 * n) if n else float("nan")
    quality = {
        "n": n,
        "displacement_mean": float(moved.mean()) if n else float("nan"),
        "displacement_median": float(np.median(moved)) if n else float("nan"),
        "displacement_p90": float(np.percentile(moved, 90)) if n else float("nan"),
        "displacement_max": int(moved.max()) if n else 0,
        "displacement_mean_vs_random": float(moved.mean() / random_mean) if n > 1 else float("nan"),
        "spearman": spearman(order),
    }
    if episode_len:
        quality["episode_len"] = int(episode_len)
        quality["same_episode_share"] = same_episode_share(order, episode_len)
        quality["same_episode_share_random"] = (episode_len - 1) / (n - 1) if n > 1 else float("nan")
    return quality


def displacements(order) -> np.ndarray:
    """|output position - source index| for each output (the array to histogram)."""
    order = np.asarray(order, dtype=np.int64)
    return np.abs(np.arange(order.size, dtype=np.int64) - order)


def spearman(order) -> float:
    """Spearman rank correlation between output position and source index (1 = unshuffled)."""
    order = np.asarray(order, dtype=np.int64)
    if order.size < 2:
        return float("nan")
    ranks = np.empty(order.size, dtype=np.float64)
    ranks[np.argsort(order, kind="stable")] = np.arange(order.size)
    positions = np.arange(order.size, dtype=np.float64)
    return float(np.corrcoef(positions, ranks)[0, 1])


def same_episode_share(order, episode_len: int) -> float:
    """Share of neighbouring outputs that come from the same episode of `episode_len` samples."""
    episodes = np.asarray(order, dtype=np.int64) // int(episode_len)
    return float(np.mean(episodes[1:] == episodes[:-1])) if episodes.size > 1 else float("nan")
