"""The command line: every `python -m nblib <verb>`; each verb calls the same function a notebook does.

One module per verb (nblib/cli/<verb>.py, its `<verb>_main(argv)`), imported only when the verb runs: a new
verb is a new file and a line of VERBS. Shared argparse types and OSError naming: nblib.cli.args.

Verbs: info, budget, cache, encode, train, suite, pipeline, export, predict. A user-facing failure (an NblibError)
prints one line, `error: ...`, and exits 2; so does an OSError (full disk, read-only folder, a path that is
a file), with the path, what the error means and what to do. No traceback.
"""
from __future__ import annotations

import importlib
import sys

from nblib.cli.args import describe_os_error
from nblib.errors import NblibError, one_line

VERBS = {verb: f"nblib.cli.{verb}:{verb}_main" for verb in
         ("info", "budget", "cache", "encode", "train", "suite", "pipeline", "export", "predict")}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `python -m nblib <verb> ...`; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in VERBS:
        print(f"usage: python -m nblib {{{','.join(VERBS)}}} [options]\n"
              f"       python -m nblib <verb> --help", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from nblib import encode  # noqa: F401  hands the encode job to the trace layer; train's: nblib.train, when used

    try:
        module, function = VERBS[argv[0]].split(":")
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    except NblibError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)   # one line, whatever a library's text held
        return 2
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:      # Ctrl-C, or SIGTERM where a verb stops on it (train)
        print(f"{str(exc) or 'interrupted'}; rerun the same command to resume", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


__all__ = ["VERBS", "main"]
