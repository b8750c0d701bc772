"""T4 projections for several models from their own FLOPs: `nblib.t4_speed` over `nblib.models.load_model`.

    python benchmarks/model_projections.py                       # the TRM and four transformers defaults
    python benchmarks/model_projections.py --model pkg.mod:build --image-size 128 --train

Each model is built from its spec with seeded random weights (nothing downloads), its forward FLOPs
per image are counted with FlopCounterMode on a CPU forward of one cache image (resized by the model's
preprocessing), and the T4 rate and time come from the sourced table as a range. Every figure
printed is a projection; none was measured on a GPU.
"""
from __future__ import annotations

import argparse
import time

from nblib import t4_speed
from nblib.models import load_model

DEFAULT_SPECS = ("trm:seed_t4", "hf:ViTModel", "hf:ResNetModel", "hf:ConvNextModel", "hf:CLIPVisionModel")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="a model spec (repeatable); default: five models")
    parser.add_argument("--image-size", type=int, default=224, help="the cache's image size (square)")
    parser.add_argument("--precision", default="fp16", choices=t4_speed.PRECISIONS)
    parser.add_argument("--train", action="store_true", help="a training step: 3 x the forward FLOPs")
    parser.add_argument("--samples", type=int, default=t4_speed.SEED_T4_IMAGES)
    args = parser.parse_args(argv)
    for spec in args.model or DEFAULT_SPECS:
        start = time.perf_counter()
        model = load_model(spec)
        p = t4_speed.model_projection(model, args.image_size, args.precision, args.train, args.samples)
        size = model.preprocessing.size or (args.image_size, args.image_size)
        print(f"{spec:<22} input {size[0]}x{size[1]}  {p.flops_per_sample / 1e9:7.2f} GFLOP  {p.summary()}  "
              f"[{time.perf_counter() - start:.1f} s on this CPU]")
    _, method = t4_speed.achieved_range(args.precision)
    print(f"method: {method}")


if __name__ == "__main__":
    main()
