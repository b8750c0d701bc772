"""Real process kills for the resume demos and tests: run a command, SIGKILL it on a condition.

The kill is what a dying Colab runtime does: no cleanup, no flush. The command runs in its own
process group, so its loader or render workers die with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def run_until(command: list[str], ready: Callable[[], bool], timeout: float = 300.0,
              poll_s: float = 0.005, env: dict | None = None) -> int:
    """Run `command`; SIGKILL its process group once `ready()` is true; return its exit code.

    The exit code is -SIGKILL when the kill landed, anything else when the command ended (or
    the timeout passed) first.
    """
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if ready():
                break
            time.sleep(poll_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode


def was_killed(returncode: int) -> bool:
    """True when an exit code says SIGKILL ended the process."""
    return returncode == -signal.SIGKILL


def cli_command(verb: str, **flags) -> list[str]:
    """The `python -m nblib VERB --flag value ...` command line; True adds a bare flag.

    cli_command("cache", texts="t.jsonl", out="c", size=64, no_progress=True); lists and tuples
    are joined with commas (`outputs=("sketches", "checksums")`); None and False are left out.
    """
    command = [sys.executable, "-m", "nblib", verb]
    for name, value in flags.items():
        option = "--" + name.replace("_", "-")
        if value is True:
            command.append(option)
        elif value is not None and value is not False:
            command += [option, ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)]
    return command
