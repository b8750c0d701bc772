"""A stalled bucket never blocks training: `python -m nblib train --mirror s3://...` against an
endpoint on 127.0.0.1 that accepts TCP connections and never answers (a frozen S3 service, not a
refused port) finishes, writes RUN/final.pt, and says what is not yet durable. A real process, a
real socket server, no stubs.

Why it can fail: with no local state the run first reads the mirror for a state to resume from.
`TrainStore.load_latest` gives that read `--mirror-timeout` seconds on a daemon thread
(`nblib.store.deadline.call_within`). Without that deadline the read runs on the main thread, and each
request waits for botocore's read timeout (30 s, 2 attempts) under the store's 3 retries: the
run hung about 5 minutes before its first step when checked by hand. The test then fails: the run
outlives the 300 s bound, and were it to end, stderr would lack "did not answer within 2 s" (the
deadline's own message). Checked: with that read calling `fn()` directly this test failed with
TimeoutExpired after 300 s (2026-11-23); with the deadline it passes in ~17 s.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_train import labelled_cache, weights_of

from conftest import subprocess_env

pytestmark = pytest.mark.slow
STEPS = 6
TIMEOUT_S = 2
SERVER_LIFETIME_S = 900          # the server thread ends on its own even if the test is killed mid-way


class StallServer:
    """Accepts every connection on 127.0.0.1 and never sends a byte; counts the connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="stall-server", daemon=True)

    def _serve(self) -> None:
        deadline = time.monotonic() + SERVER_LIFETIME_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return                                  # the listening socket was closed
            self.accepted.append(conn)                  # held open, never answered

    def __enter__(self) -> StallServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_a_stalled_bucket_never_blocks_training_and_the_report_says_what_is_not_durable(tmp_path):
    from nblib.manifest import read_manifest
    from nblib.train.loop import REPORT, REPORT_KIND

    cache = labelled_cache(tmp_path / "data", 80)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nblib", "train", "--cache", str(cache), "--out", str(out), "--steps", str(STEPS),
           "--batch-size", "16", "--save-every", "2", "--backup-every", "2", "--eval-every", "3", "--no-progress",
           "--mirror", "s3://stall/exp", "--mirror-timeout", str(TIMEOUT_S)]
    with StallServer() as server:
        env = subprocess_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                             AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.port}", AWS_ACCESS_KEY_ID="testing",
                             AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=300)   # generous: the stall costs ~2 x TIMEOUT_S here
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        accepted = len(server.accepted)
    assert proc.returncode == 0, stderr[-3000:]
    assert accepted >= 1, "the run never reached the stalled endpoint: the test did not test a stall"
    # The start-up reads of the mirror (its claim, mirror.json, then the newest state) gave up at the
    # deadline (--mirror-timeout) and the run started afresh.
    assert re.search(rf"the mirror (\S+ )?did not answer within {TIMEOUT_S} s", stderr), stderr[-3000:]
    assert "training starts from step 0" in stderr, stderr[-3000:]
    # Training finished locally ...
    assert (out / "final.pt").exists()
    assert weights_of(out)
    # ... and the report says which state is only on local disk (stdout and RUN/train.json).
    expected = (f"NOT YET DURABLE: the mirror has not confirmed step {STEPS}",
                f"the newest state (step {STEPS}) is on local disk only")
    assert all(text in stdout for text in expected), stdout
    durability = read_manifest(Path(out) / REPORT, REPORT_KIND).body["durability"]
    assert all(text in durability for text in expected), durability
