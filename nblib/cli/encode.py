"""`python -m nblib encode`: a streaming, resumable encode (torchrun-aware)."""
from __future__ import annotations

import argparse

from nblib.cli.args import parse_or_refuse, positive_int, seed_int
from nblib.config import OUTPUT_DTYPES, OUTPUT_NAMES, named_config
from nblib.errors import ConfigError, os_errors_name
from nblib.models.load import spec_forms


def encode_main(argv: list[str]) -> int:
    """`python -m nblib encode`: stream the encoder over a cache into durable, resumable parts."""
    from nblib import env
    from nblib.cache import ShardedImageCache
    from nblib.disk import refuse_overlap
    from nblib.encode import VerifyLevel, encode
    from nblib.encode.distributed import join

    args = parse_or_refuse(_encode_parser(), argv)
    if args.cache and args.input_key:
        raise ConfigError("--input-key goes with --records (record shards of token ids); --cache holds images")
    data = {"--cache": args.cache} if args.cache else {"--records": args.records}
    refuse_overlap("encode", args.out, data, suffix="encoded")
    refuse_overlap("encode", args.mirror, data, out_flag="--mirror", suffix="mirror")
    source = ShardedImageCache(args.cache) if args.cache else _token_records(args)
    config = _encode_config(args, env.profile())
    # the --outputs names; None: the TRM's configured ones, or all another model returns
    outputs = tuple(o.strip() for o in args.outputs.split(",") if o.strip()) if args.outputs else None
    world = join(shard=args.shard, consolidate_only=args.consolidate, device=args.device)  # torchrun ranks too
    try:
        with os_errors_name(args.out):
            report = encode(source, args.out, config, device=world.device,
                            mirror_dir=args.mirror, progress=not args.no_progress, offload=args.offload,
                            weights=args.weights, model=args.model, outputs=outputs,
                            preflight=not args.no_preflight, world=world,
                            verify=VerifyLevel.HASH if args.verify else VerifyLevel.STAT,
                            precision=args.precision, reencode_numerics=args.reencode_numerics)
    finally:
        world.close()
    if world.reports:   # the other ranks of a launch stay quiet
        print(report)
    return 0


def _encode_parser() -> argparse.ArgumentParser:
    from nblib.encode import OFFLOAD_MODES
    from nblib.encode.numerics import PRECISIONS

    p = argparse.ArgumentParser(prog="python -m nblib encode", description=encode_main.__doc__,
                                exit_on_error=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--cache", help="folder of a ShardedImageCache")
    source.add_argument("--records", help="instead of --cache: record shards (cache --records) whose --input-key "
                        "field holds each text's token ids, for a text encoder --model (hf:BertModel:config.json)")
    p.add_argument("--input-key", help="with --records: the field of token ids (1-D integers per record)")
    p.add_argument("--input", default="tokens", help="with --records: tokens (padded to the longest record) or "
                   "tokens:LENGTH (each record padded to LENGTH; shorter than the longest record is refused)")
    p.add_argument("--out", required=True, help="run folder: parts, manifest, consolidated .npy")
    p.add_argument("--profile", help="smoke | t4 | full, or a preset name (default: NBLIB_PROFILE)")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--checkpoint-every", type=positive_int, help="batches per durable part")
    p.add_argument("--outputs", help=f"comma-separated outputs to store: of the TRM {','.join(OUTPUT_NAMES)}; "
                   f"of another model, the names its forward returns (default: all)")
    p.add_argument("--dtype", choices=OUTPUT_DTYPES, help="dtype of the stored outputs")
    p.add_argument("--mirror", help="durable mirror folder (e.g. on Google Drive)")
    p.add_argument("--model", help=f"{spec_forms()} (default trm); built with seeded random weights, nothing "
                   "downloaded")
    p.add_argument("--weights", help="a state-dict file (safetensors or torch) loaded strictly over the model")
    p.add_argument("--seed", type=seed_int, help="seed of the initial weights")
    p.add_argument("--workers", type=int, help="DataLoader worker processes (0: read in the main one)")
    p.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    p.add_argument("--offload", choices=OFFLOAD_MODES, default="async")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="encoder precision: auto (fp16 autocast on CUDA, fp32 on CPU), fp32, fp16, bf16")
    p.add_argument("--reencode-numerics", action="store_true",
                   help="on a resume with another device, precision or torch: encode again the parts made "
                        "with the other numerics (default: refuse, naming the change)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-preflight", action="store_true", help="skip the budget check")
    p.add_argument("--verify", action="store_true", help="hash every durable part before resuming (default: "
                   "metadata only; consolidation hashes every part it reads anyway)")
    p.add_argument("--shard", metavar="I/N", help="encode part set I of N (machines sharing only --out); "
                   "then run --consolidate once")
    p.add_argument("--consolidate", action="store_true", help="only merge the parts the shards wrote; "
                   "names the missing parts and shards")
    return p


def _token_records(args: argparse.Namespace):
    """--records with --input-key and --input tokens[:LENGTH]: the records as an encode source."""
    from nblib.encode.token_records import TokenRecords

    kind, _, length = args.input.partition(":")
    if kind != "tokens" or not (length == "" or (length.isdigit() and int(length) > 0)):
        raise ConfigError(f"--input {args.input!r}: --records are read as tokens or tokens:LENGTH (e.g. tokens:128)")
    if not args.input_key:
        raise ConfigError("--records needs --input-key: the field of each record that holds its token ids")
    return TokenRecords(args.records, args.input_key, int(length) if length else None)


def _encode_config(args: argparse.Namespace, default_profile: str):
    """The profile's (or preset's) config with the flags given applied."""
    import math

    config = named_config(args.profile or default_profile)
    flags = {"batch_size": args.batch_size, "out_dtype": args.dtype, "seed": args.seed, "workers": args.workers}
    changes = {knob: value for knob, value in flags.items() if value is not None}
    if args.checkpoint_every is not None:
        changes.update(checkpoint_every=args.checkpoint_every,
                       consolidate_every=math.gcd(args.checkpoint_every, config.run.consolidate_every))
    return config.replace(**changes) if changes else config
