"""`python -m nblib suite`: every notebook, headless."""
from __future__ import annotations

import argparse


def suite_main(argv: list[str]) -> int:
    """`python -m nblib suite`: run every notebook headless and print the summary table."""
    from nblib import env
    from nblib.suite import KERNEL_THREADS, format_table, kernel_environment, run_suite

    parser = argparse.ArgumentParser(prog="python -m nblib suite", description=suite_main.__doc__)
    parser.add_argument("--notebooks", default=None, help="folder of NN_*.ipynb (default notebooks/)")
    parser.add_argument("--out", default=None, help="executed copies go here (default outputs/notebooks)")
    parser.add_argument("--inactivity-s", type=float, default=None,
                        help="fail a notebook whose kernel sends nothing for this long (default "
                             "NBLIB_SUITE_INACTIVITY_S, else 300)")
    args = parser.parse_args(argv)
    threads = " ".join(f"{k}={v}" for k, v in kernel_environment().items() if k in KERNEL_THREADS)
    print(f"profile: {env.profile()}   outputs: {env.outputs_dir()}   kernels: {threads}", flush=True)
    results = run_suite(args.notebooks, args.out, inactivity_s=args.inactivity_s)
    print(format_table(results))
    failed = [r for r in results if r.status != "ok"]
    for r in failed:
        print(f"FAILED {r.name}: {r.error}")
    if not results:
        print("no notebooks found")
        return 1
    return 1 if failed else 0
