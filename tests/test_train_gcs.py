"""`python -m nblib train --mirror gs://...` against a real GCS JSON-API server on 127.0.0.1
(gcp-storage-emulator, started as its own process): the bucket holds the backups, and a resume
from the bucket alone (the run folder deleted, as on a new Colab VM) ends with the uninterrupted
run's weights, bit for bit. Beside it, the gs:// file operations themselves: the emulator's
objects round-trip, and a server answering 503 gets the mirror's 2 attempts (not gcsfs's 6) and
an OSError naming the bucket, which the mirror retries as it retries Drive.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_train import assert_same_weights, labelled_cache, weights_of
from train_runs import (
    bucket_holds_a_state,
    free_port,
    ls_or_empty,
    run_and_kill,
    train_cli,
    train_env,
    uninterrupted_weights,
)

pytestmark = pytest.mark.slow
BUCKET, PREFIX = "runs", "runs/exp1"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("gcs"), 160)


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> dict:
    return uninterrupted_weights(cache_dir, tmp_path_factory.mktemp("ref") / "run")


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """(endpoint, gcsfs filesystem) of a gcp-storage-emulator process on a free port of 127.0.0.1."""
    pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (pinned in requirements.txt)")
    pytest.importorskip("gcp_storage_emulator", reason="the GCS server is gcp-storage-emulator (requirements.txt)")
    from nblib.train.objstore import open_filesystem

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(tmp_path / "emulator.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                   "--port", str(port), "--in-memory", "--quiet"], stdout=log, stderr=log)
        try:
            _wait_until_up(endpoint, server, tmp_path / "emulator.log")
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
            yield endpoint, open_filesystem("gs")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_a_real_gcs_server_holds_the_backups_and_a_resume_from_the_bucket_alone_is_exact(cache_dir, reference,
                                                                                           tmp_path, gcs):
    endpoint, fs = gcs
    fs.mkdir(BUCKET)
    out = tmp_path / "run"
    cmd = train_cli(cache_dir, out, "--mirror", f"gs://{PREFIX}")
    env = train_env(STORAGE_EMULATOR_HOST=endpoint)
    run_and_kill(cmd, out, extra_s=0, env=env, done=lambda: bucket_holds_a_state(fs, PREFIX))
    assert not (out / "final.pt").exists()
    shutil.rmtree(out)                                           # a new VM: only the bucket survives
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from mirror" in done.stdout and "mirror holds step 12" in done.stdout, done.stdout
    assert_same_weights(weights_of(out), reference)
    names = {p.rsplit("/", 1)[-1] for p in ls_or_empty(fs, f"{PREFIX}/checkpoints")}
    assert "state-000012.pt" in names and "state-000012.json" in names
    assert len([n for n in names if n.startswith("state-") and n.endswith(".pt")]) <= 3     # keep_last on the bucket
    local = (out / "checkpoints" / "state-000012.pt").read_bytes()
    assert fs.cat_file(f"{PREFIX}/checkpoints/state-000012.pt") == local


def test_gs_objects_round_trip_through_the_mirrors_file_operations(gcs):
    from nblib.train.objstore import mirror_target

    _, fs = gcs
    fs.mkdir(BUCKET)
    root, ops = mirror_target(f"gs://{PREFIX}")
    assert root == Path(PREFIX)
    data = bytes(range(256)) * 4096
    written = ops.write_atomic(root / "a.bin", [data[:1000], memoryview(data[1000:])])
    assert (written.bytes, ops.read_bytes(root / "a.bin"), ops.stat(root / "a.bin").st_size) == (len(data), data,
                                                                                                   len(data))
    assert ops.listdir(root) == ["a.bin"] and ops.is_dir(root)
    with pytest.raises(ValueError, match="expected"):
        ops.write_atomic(root / "b.bin", [b"x"], expect_sha256=written.sha256)
    assert ops.read_bytes(root / "b.bin") is None                # a refused write leaves no object
    ops.unlink(root / "a.bin")
    with pytest.raises(FileNotFoundError):
        ops.unlink(root / "a.bin")
    with pytest.raises(FileNotFoundError):
        ops.listdir(root / "none")


def test_a_failing_gcs_endpoint_gets_two_attempts_and_an_oserror_naming_the_bucket(monkeypatch):
    pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (pinned in requirements.txt)")
    from nblib.train.objstore import ATTEMPTS, mirror_target

    with _Failing503() as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_port}")
        root, ops = mirror_target("gs://down/exp")
        with pytest.raises(OSError, match="gs://down/exp: HttpError") as caught:
            ops.write_atomic(root / "state.pt", [b"state"])
    assert not isinstance(caught.value, FileNotFoundError)
    assert server.requests == ATTEMPTS == 2                      # gcsfs alone makes 6, with ~31 s of backoff


class _Failing503(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that answers every request 503 and counts them."""

    def __init__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's names)
                self._fail()

            def do_POST(self):  # noqa: N802
                self._fail()

            def _fail(self):
                outer.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                body = b'{"error": {"code": 503, "message": "backend unavailable"}}'
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.requests = 0
        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="gcs-503", daemon=True)

    def __enter__(self) -> _Failing503:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def _wait_until_up(endpoint: str, server: subprocess.Popen, log: Path) -> None:
    """Poll the emulator's health check ('OK' on /) until it answers; fail with its log if it exits."""
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, f"gcp-storage-emulator exited {server.returncode}: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(endpoint + "/", timeout=2) as answer:
                if answer.read() == b"OK":
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"gcp-storage-emulator did not answer in 120 s: {log.read_text()[-2000:]}"
        time.sleep(0.05)
