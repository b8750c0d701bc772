"""`make install`'s uv path (scripts/uv_install.py) sees what pip sees, and gives way to pip when uv is not there.

uv reads none of pip's configuration, so without the bridge it takes torch from PyPI (the CUDA build and
its nvidia-* packages) where pip here takes the CPU wheel from a find-links folder. These tests need no
network: pip's configuration is read with `pip config list`, and uv's absence is made by an empty index.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import uv_install  # noqa: E402


def test_uv_gets_pips_find_links_indexes_and_constraint_and_picks_versions_as_pip(tmp_path, monkeypatch):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /wheels/cpu\nextra-index-url = file:///mirror/a file:///mirror/b\n"
                    "constraint = /etc/caps.txt\ncert = /etc/ca.pem\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels/env")
    settings = uv_install.pip_settings(sys.executable)
    args = uv_install.uv_arguments(settings)
    pairs = set(zip(args, args[1:]))
    assert ("--index-strategy", "unsafe-best-match") in pairs, "pip picks the best version across indexes"
    assert {("--find-links", "/wheels/env"), ("--extra-index-url", "file:///mirror/a"),
            ("--extra-index-url", "file:///mirror/b"), ("--constraint", "/etc/caps.txt")} <= pairs, args
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert uv_install.uv_environment(settings)["SSL_CERT_FILE"] in {"/etc/ca.pem", os.environ.get("PIP_CERT")}


def test_without_uv_to_be_had_the_installer_says_so_and_exits_non_zero_for_pip_to_take_over(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    import sysconfig

    Path(site, "host.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")   # this pip, not uv
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "uv_install.py"), python, str(requirements)],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert f"pip could not install uv=={uv_install.UV_VERSION}; pip installs instead" in done.stderr, done.stderr
    assert not (venv / "bin" / "uv").exists()


def test_the_installed_torch_has_its_bytecode_so_no_process_compiles_it_again():
    """pip writes .pyc files at install, uv only with --compile-bytecode. Without them, where
    PYTHONDONTWRITEBYTECODE=1 (this machine and CI), every process compiled torch from source:
    `import torch, torch._dynamo` took 6.7 CPU-s instead of 3.0 in a fresh clone's venv, and the suite 14.5 min.
    """
    import importlib.util

    spec = importlib.util.find_spec("torch._dynamo")
    if spec is None or spec.origin is None:
        pytest.skip("torch is not installed here")
    for module in ("torch", "torch._dynamo", "torch.nn.modules.module"):
        origin = importlib.util.find_spec(module).origin
        assert Path(importlib.util.cache_from_source(origin)).exists(), f"{module}: no .pyc beside {origin}"
