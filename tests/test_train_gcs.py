"""`python -m nblib train --mirror gs://...` against a real GCS JSON-API server on 127.0.0.1
(gcp-storage-emulator, started as its own process): the bucket holds the backups, and a resume
from the bucket alone (the run folder deleted, as on a new Colab VM) ends with the uninterrupted
run's weights, bit for bit; a dead or stalled endpoint never blocks training. Beside it, the gs:// file
operations themselves: the emulator's objects round-trip, and a server answering 503 gets the
mirror's 2 attempts (not gcsfs's 6) and an OSError naming the bucket, which the mirror retries as
it retries Drive.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from train_runs import (
    assert_the_bucket_alone_resumes_exactly,
    cache_and_reference,
    free_port,
    train_cli,
    train_env,
)

pytestmark = pytest.mark.slow
BUCKET, PREFIX = "runs", "runs/exp1"
SHORT = ["--steps", "4", "--backup-every", "2"]      # the dead and stalled runs: two backups are enough


cache_dir, reference = cache_and_reference("gcs")


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
    assert_the_bucket_alone_resumes_exactly(cache_dir, reference, tmp_path / "run", fs, f"gs://{PREFIX}",
                                            train_env(STORAGE_EMULATOR_HOST=endpoint))


def test_a_dead_gcs_endpoint_never_blocks_training_and_the_report_says_what_is_not_durable(cache_dir, tmp_path):
    pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (pinned in requirements.txt)")
    out = tmp_path / "run"                                       # nothing listens on the port: every request fails
    cmd = train_cli(cache_dir, out, "--mirror", "gs://gone/exp", "--mirror-timeout", "2", *SHORT)
    done = subprocess.run(cmd, env=train_env(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{free_port()}"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NOT YET DURABLE: the mirror has not confirmed step 4" in done.stdout, done.stdout
    assert (out / "final.pt").exists()
    assert "out of retries" not in done.stderr                  # gcsfs's per-request tracebacks stay quiet


def test_a_stalled_gcs_endpoint_never_blocks_training(cache_dir, tmp_path):
    """An endpoint that accepts and never answers (test_train_stall's server): the start-up read gives up at
    --mirror-timeout, the run trains from step 0 to the end and says what is only on local disk.
    """
    pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (pinned in requirements.txt)")
    from test_train_stall import StallServer

    out = tmp_path / "run"
    with StallServer() as server:
        done = subprocess.run(train_cli(cache_dir, out, "--mirror", "gs://stall/exp", "--mirror-timeout", "2", *SHORT),
                              env=train_env(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{server.port}"),
                              capture_output=True, text=True, timeout=300)
        accepted = len(server.accepted)
    assert done.returncode == 0, done.stderr[-3000:]
    assert accepted >= 1, "the run never reached the stalled endpoint"
    assert re.search(r"the mirror (\S+ )?did not answer within 2 s", done.stderr), done.stderr[-3000:]
    assert "NOT YET DURABLE" in done.stdout and (out / "final.pt").exists(), done.stdout


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
        ops.write_atomic(root / "b.bin", [b"x"], expect_digest=written.sha256)
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
