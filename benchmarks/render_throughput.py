"""Render throughput per core at 224 px: PIL's built-in font (git HEAD's render.py) vs the shipped font chain.

Rates are images per CPU-second of this process (time.process_time), so they read as "per core" and
stay comparable on a shared machine; wall-clock rates are printed beside them. Both renderers run
over the same texts (data/sample_texts.jsonl) in alternating rounds after a warm-up, best round kept.

    .venv/bin/python benchmarks/render_throughput.py [--size 224] [--rounds 3] [--rev HEAD]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nblib import render  # noqa: E402

TARGET_TWO_CORES = 345.0  # images/s the T4 encoder consumes (projected); 2 Colab cores must keep up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rev", default="HEAD", help="git revision whose nblib/render.py is the old renderer")
    args = parser.parse_args()
    with (REPO / "data" / "sample_texts.jsonl").open(encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    old = old_renderer(args.rev)
    old_params, new_params = old.render_params(args.size), render.render_params(args.size)
    renderers = {f"old: built-in font ({args.rev})": lambda t: old.render_with(t, old_params),
                 f"new: font chain, {new_params.layout}": lambda t: render.render_with(t, new_params)}
    subsets = {"all": texts,
               "non-ASCII": [t for t in texts if any(ord(c) > 127 for c in t)]}
    print(f"{len(texts):,} sample texts ({len(subsets['non-ASCII']):,} non-ASCII), {args.size} px, "
          f"best of {args.rounds} rounds; rates in images per CPU-second (= per core), wall in brackets")
    for name, subset in subsets.items():
        rates = measure(renderers, subset, args.rounds)
        for label, (cpu_rate, wall_rate) in rates.items():
            print(f"  {name:<10} {label:<36} {cpu_rate:8.0f} images/s per core  ({wall_rate:.0f} wall)")
        (old_rate, _), (new_rate, _) = rates.values()
        print(f"  {name:<10} new/old ratio {new_rate / old_rate:.2f}; 2 cores new: {2 * new_rate:.0f} images/s "
              f"vs target {TARGET_TWO_CORES:.0f} ({'meets' if 2 * new_rate >= TARGET_TWO_CORES else 'MISSES'} it)")


def measure(renderers: dict, texts: list[str], rounds: int) -> dict:
    """Best (CPU, wall) images/s of each renderer over `texts`, rounds alternating between renderers."""
    for draw in renderers.values():  # warm-up: fonts, cmaps, width caches
        for text in texts[:200]:
            draw(text)
    best = {label: (0.0, 0.0) for label in renderers}
    for _ in range(rounds):
        for label, draw in renderers.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for text in texts:
                draw(text)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best[label] = max(best[label], (len(texts) / cpu, len(texts) / wall))
    return best


def old_renderer(rev: str):
    """nblib/render.py as of `rev`, imported as a separate module."""
    source = subprocess.run(["git", "show", f"{rev}:nblib/render.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="old_render_")) / "old_render.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("old_render", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_render"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
