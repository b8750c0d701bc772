"""One trace cache keyed by what shapes a trace, in a per-user folder of mode 0700 (nblib.budget.trace_store).

Colab's torch says `2.13.0+cu126` where the table was traced under `2.13.0+cpu`: one torch for a trace (its
major.minor), so the shipped table answers there without a child. The fake-CUDA shim's library is compiled into
the per-user folder, never at a fixed name in the shared temp folder.
"""
from __future__ import annotations

import os
import stat
import sys

import pytest

from nblib.budget import encode_trace, trace_store
from nblib.config import preset


def _fresh_caches() -> None:
    encode_trace._stream.cache_clear()
    encode_trace._at_batch.cache_clear()


def _bytes(v) -> tuple:
    return [(ln.name, ln.bytes) for ln in v.lines], v.reserved_by_position, v.peak_op


def test_colabs_cuda_build_of_torch_hits_the_shipped_table_with_the_same_answer(monkeypatch):
    torch = pytest.importorskip("torch")
    config = preset("seed_t4").replace(batch_size=160)
    _fresh_caches()
    here = encode_trace.encode_vram(config, "t4")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu126")
    monkeypatch.setattr(trace_store, "version", lambda name: "2.13.0+cu126")

    def no_child(*args, **kwargs):
        raise AssertionError("the budget traced in a child: the shipped table was missed")

    monkeypatch.setattr(encode_trace, "run_job", no_child)
    _fresh_caches()
    try:
        colab = encode_trace.encode_vram(config, "t4")
    finally:
        _fresh_caches()
    assert _bytes(colab) == _bytes(here)
    assert "replayed from nblib/trace_seed" in colab.label and "torch 2.13," in colab.label


def test_the_key_is_torchs_release_the_format_and_the_shaping_variables(monkeypatch):
    """A build suffix or a patch release is one trace; another minor release, format or allocator setting is not;
    where files go (NBLIB_OUTPUTS) and the preset that chose a shape (NBLIB_PROFILE) are not in the key.
    """
    spec = {"spec": "trm", "cc": 75}
    names = {}
    for full in ("2.13.0+cpu", "2.13.1+cu126", "2.14.0"):
        monkeypatch.setattr(trace_store, "version", lambda name, full=full: full)
        if "torch" in sys.modules:
            monkeypatch.setattr(sys.modules["torch"], "__version__", full)
        names[full] = trace_store.entry_name(trace_store.entry_key(spec, trace_store.torch_release()))
    assert names["2.13.0+cpu"] == names["2.13.1+cu126"] != names["2.14.0"]
    base = trace_store.entry_name(trace_store.entry_key(spec, "2.13"))
    monkeypatch.setenv("NBLIB_OUTPUTS", "/elsewhere")
    monkeypatch.setenv("NBLIB_PROFILE", "t4")
    assert trace_store.entry_name(trace_store.entry_key(spec, "2.13")) == base
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert trace_store.entry_name(trace_store.entry_key(spec, "2.13")) != base
    monkeypatch.setattr(trace_store, "TRACE_FORMAT", trace_store.TRACE_FORMAT + 1)
    assert trace_store.entry_name(trace_store.entry_key(spec, "2.13", {})) != base


def test_the_shim_library_is_compiled_into_the_users_0700_folder(monkeypatch, tmp_path):
    from nblib.budget import shim

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        path = shim.shim_path()
    except shim.SimulationUnavailable as exc:
        pytest.skip(str(exc))
    user = trace_store.user_folder()
    assert user == tmp_path / "xdg" / "nblib" and path.parent == user / "shim"
    for folder in (user, path.parent):
        st = os.stat(folder)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid(), folder
    assert shim.shim_path() == path                     # built once, then found


def test_a_user_folder_that_is_a_link_or_open_to_others_is_refused_or_closed(monkeypatch, tmp_path):
    from nblib.errors import ConfigError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    (tmp_path / "planted").mkdir(mode=0o777)
    (tmp_path / "xdg" / "nblib").symlink_to(tmp_path / "planted")
    with pytest.raises(ConfigError, match="is a link, not a folder, or belongs to"):
        trace_store.user_folder("shim")
    (tmp_path / "xdg" / "nblib").unlink()
    (tmp_path / "xdg" / "nblib").mkdir(mode=0o755)
    os.chmod(tmp_path / "xdg" / "nblib", 0o777)
    folder = trace_store.user_folder("traces")
    assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700


def test_a_spec_outside_the_table_is_traced_once_and_then_read_from_the_users_folder(monkeypatch, tmp_path):
    """... until nblib's own code changes: an entry of the user's folder is keyed by its digest too."""
    from nblib.budget.shim import backward_capability

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    config = preset("smoke").replace(dim=80, batch_size=24)
    _fresh_caches()
    traced = encode_trace.encode_vram(config, "t4")
    kept = list((tmp_path / "xdg" / "nblib" / "traces").glob("trm-encode-*.json"))
    assert len(kept) == 1 and "replayed" not in traced.label

    def no_child(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(encode_trace, "run_job", no_child)
    _fresh_caches()
    try:
        again = encode_trace.encode_vram(config, "t4")
    finally:
        _fresh_caches()
    assert _bytes(again) == _bytes(traced) and f"the trace cache {kept[0].parent}" in again.label
    monkeypatch.setattr(trace_store, "source_digest", lambda: "an-edited-nblib")    # another nblib's code
    with pytest.raises(AssertionError, match="traced again"):
        encode_trace.encode_vram(config, "t4")
    _fresh_caches()


def test_a_user_folder_that_cannot_be_made_is_one_line_and_the_shipped_table_still_answers(monkeypatch, tmp_path):
    from nblib.errors import ConfigError

    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    with pytest.raises(ConfigError, match="cannot be made .*set XDG_CACHE_HOME"):
        trace_store.user_folder("shim")
    _fresh_caches()
    try:
        assert "nblib/trace_seed" in encode_trace.encode_vram(preset("seed_t4"), "t4").label
    finally:
        _fresh_caches()
