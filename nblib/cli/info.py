"""`python -m nblib info`."""
from __future__ import annotations

import argparse


def info_main(argv: list[str]) -> int:
    """`python -m nblib info`: runtime, profile, workspace folders and the hardware report."""
    from nblib.env import hardware_report, profile, runtime, workspace

    parser = argparse.ArgumentParser(prog="python -m nblib info", description=info_main.__doc__)
    parser.parse_args(argv)
    ws = workspace()
    print(f"runtime  {runtime()}\nprofile  {profile()}")
    for name, folder in ws.as_dict().items():
        print(f"{name:<9}{folder}")
    print(hardware_report(drive=ws.drive, local=ws.local))
    return 0
