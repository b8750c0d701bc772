"""Install a requirements file into a venv with uv, resolving as pip would here (`make install`'s fast path).

    python scripts/uv_install.py .venv/bin/python requirements.txt

uv does not read pip's configuration (pip.conf, PIP_* variables), and by default it takes a package
from the first index that has it, where pip takes the best version across all of them. On a machine
whose pip finds a CPU build of torch through `find-links` (torch 2.13.0+cpu), plain `uv pip install`
would fetch PyPI's CUDA build and a dozen nvidia-* packages instead. So this passes uv pip's own
find-links, indexes, constraints and certificate, with `--index-strategy unsafe-best-match`, and
exits non-zero (for the Makefile to fall back to pip) when uv cannot be installed, fails, or resolves
to any nvidia-* package that pip would not have chosen (a CUDA package in a CPU requirements file).
uv is pinned (UV_VERSION) and installed into the venv with pip. Exit 0: installed by uv.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

UV_VERSION = "0.13.8"
# pip option -> uv option; pip's extra-index-url and find-links hold several values separated by spaces
BRIDGED = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
CUDA_PACKAGE = re.compile(r"^\s*[+]\s*(nvidia-|cuda-)", re.MULTILINE)


def pip_settings(python: str) -> dict[str, list[str]]:
    """pip's effective options for `python` (config files and PIP_* variables), as `pip config list` shows them."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    settings: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        values = value.strip().strip("'\"").split()
        for item in values:
            if item not in settings.setdefault(name, []):
                settings[name].append(item)
    for name in ("constraint", "cert"):       # pip also reads PIP_CONSTRAINT, PIP_CERT directly
        env = os.environ.get(f"PIP_{name.upper()}")
        if env and env not in settings.setdefault(name, []):
            settings[name].append(env)
    return settings


def uv_arguments(settings: dict[str, list[str]]) -> list[str]:
    """uv pip install options that make it see what pip sees, and pick versions as pip does."""
    args = ["--index-strategy", "unsafe-best-match"]
    for name, option in BRIDGED.items():
        for value in settings.get(name, []):
            args += [option, value]
    return args


def uv_environment(settings: dict[str, list[str]]) -> dict[str, str]:
    """The environment for uv: pip's certificate bundle (uv has its own roots otherwise), no venv guessing."""
    env = dict(os.environ)
    if settings.get("cert"):
        env.setdefault("SSL_CERT_FILE", settings["cert"][-1])
    return env


def install(python: str, requirements: str) -> int:
    """Install `requirements` into `python`'s environment with uv; 0 when uv did it, else why not (stderr)."""
    uv = Path(python).parent / "uv"
    if not uv.exists() or _uv_version(uv) != UV_VERSION:
        got = subprocess.run([python, "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"])
        if got.returncode or not uv.exists():
            print(f"uv_install: pip could not install uv=={UV_VERSION}; pip installs instead", file=sys.stderr)
            return 1
    settings = pip_settings(python)
    command = [str(uv), "pip", "install", "--python", python, "-r", requirements, *uv_arguments(settings)]
    env = uv_environment(settings)
    plan = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, env=env)
    if plan.returncode:
        print(f"uv_install: uv could not resolve {requirements}: "
              f"{(plan.stderr.strip().splitlines() or ['?'])[-1]}; pip installs instead", file=sys.stderr)
        return 1
    if CUDA_PACKAGE.search(plan.stderr + plan.stdout) and "nvidia" not in Path(requirements).read_text():
        print("uv_install: uv would install CUDA packages (nvidia-*, cuda-*) that the CPU requirements do not "
              "name; pip installs instead", file=sys.stderr)
        return 1
    # --compile-bytecode: the .pyc files pip writes at install and uv does not. Without them, where
    # PYTHONDONTWRITEBYTECODE=1 (this machine and CI), every process compiled torch from source again:
    # `import torch, torch._dynamo` took 6.7 CPU-s instead of 3.0, in each of the tests' processes and kernels.
    done = subprocess.run([*command, "--quiet", "--compile-bytecode"], env=env)
    if done.returncode:
        print(f"uv_install: uv pip install exited {done.returncode}; pip installs instead", file=sys.stderr)
    return done.returncode


def _uv_version(uv: Path) -> str:
    try:
        out = subprocess.run([str(uv), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    return out.split()[1] if len(out.split()) > 1 else ""


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(install(sys.argv[1], sys.argv[2]))
