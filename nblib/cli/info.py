"""`python -m nblib info`."""
from __future__ import annotations

import argparse


def info_main(argv: list[str]) -> int:
    """`python -m nblib info`: runtime, profile, workspace folders and the hardware report."""
    from nblib.env import hardware_report, profile, runtime, workspace

    parser = argparse.ArgumentParser(prog="python -m nblib info", description=info_main.__doc__)
    parser.parse_args(argv)
    ws = workspace()
    rows = {"runtime": runtime(), "profile": profile(), **ws.as_dict()}
    width = max(len(name) for name in rows) + 2          # every label, the longest too, a space from its value
    for name, value in rows.items():
        print(f"{name:<{width}}{value}")
    print(hardware_report(drive=ws.drive, local=ws.local))
    return 0
