"""Encoding records of token ids with a text encoder (issue 49: inputs other than images for `encode`):
`encode --records DIR --input-key ids --model hf:BertModel:...` pads each record to the longest, masks the
padding, and stores what the model gives each record alone; a SIGKILL and a rerun give the uninterrupted run's
bytes; its CUDA preflight is `budget --input tokens:LENGTH`; what it cannot read is one line. Real record shards,
a tiny BertModel from its config, the real CLI.
"""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from cli_runner import run_nblib
from test_encode_models import _every_output_byte, _kill_after

from conftest import subprocess_env

transformers = pytest.importorskip("transformers")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def bert(tiny_bert) -> str:
    return tiny_bert


def token_records(folder, n: int, seed: int = 0) -> list:
    from nblib.cache import write_records

    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 200, int(rng.integers(3, 33))).astype(np.int64) for _ in range(n)]
    write_records(({"ids": x, "score": np.float32(len(x))} for x in ids), folder, shard_mb=0.002)
    return ids


def _encode(records, out, bert, *extra):
    return run_nblib("encode", "--records", records, "--input-key", "ids", "--model", bert, "--out", out,
                     "--profile", "smoke", "--batch-size", "8", "--checkpoint-every", "1", "--no-progress", *extra,
                     **THREADS)


def test_each_record_is_encoded_as_the_model_gives_it_alone(bert, tmp_path):
    from nblib.models import load_model

    ids = token_records(tmp_path / "records", 40)
    done = _encode(tmp_path / "records", tmp_path / "run", bert)
    assert done.returncode == 0, done.stderr
    hidden = np.load(tmp_path / "run" / "last_hidden_state.npy")
    pooled = np.load(tmp_path / "run" / "pooler_output.npy")
    longest = max(len(x) for x in ids)
    assert hidden.shape == (40, longest, 32) and pooled.shape == (40, 32)
    import torch

    model = load_model(bert, inputs="tokens").module.eval()      # the same seeded weights
    with torch.no_grad():
        for i in (0, 7, 39):
            alone = model(input_ids=torch.from_numpy(ids[i])[None])
            np.testing.assert_allclose(pooled[i], alone.pooler_output[0].numpy(), rtol=1e-2, atol=1e-2)
            np.testing.assert_allclose(hidden[i, :len(ids[i])], alone.last_hidden_state[0].numpy(),
                                       rtol=1e-2, atol=1e-2)


def test_killed_and_resumed_gives_every_byte_of_an_uninterrupted_run(bert, tmp_path):
    records = tmp_path / "records"
    token_records(records, 600)
    whole = _encode(records, tmp_path / "whole", bert, "--batch-size", "2")
    assert whole.returncode == 0, whole.stderr
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "nblib", "encode", "--records", str(records), "--input-key", "ids", "--model",
           bert, "--out", str(killed), "--profile", "smoke", "--batch-size", "2", "--checkpoint-every", "1",
           "--no-progress"]
    _kill_after(cmd, killed, 3, subprocess_env(**THREADS))
    resumed = _encode(records, killed, bert, "--batch-size", "2")
    assert resumed.returncode == 0 and "resumed at sample" in resumed.stdout, resumed.stderr
    assert _every_output_byte(killed) == _every_output_byte(tmp_path / "whole")
    other = _encode(records, killed, bert, "--batch-size", "2", "--input", "tokens:64")
    assert other.returncode != 0 and "Traceback" not in other.stderr     # another length is another run


def test_what_it_cannot_read_is_one_line(bert, tmp_path):
    ids = token_records(tmp_path / "records", 12)
    longest = max(len(x) for x in ids)
    for extra, says in ((("--input", "tokens:4"), f"shorter than the longest record of {tmp_path / 'records'} "
                                                  f"({longest} tokens)"),
                        (("--input", "words"), "--records are read as tokens or tokens:LENGTH"),
                        (("--input-key", "score"), "encode --records reads token ids"),
                        (("--input-key", "text"), "is not a field of the records"),
                        (("--model", "trm"), "the TRM takes images")):
        done = _encode(tmp_path / "records", tmp_path / "run", bert, *extra)
        error = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(error) == 1 and says in error[0], (extra, done.stderr)


def test_its_cuda_preflight_is_the_token_budget(bert, tmp_path, monkeypatch):
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    import torch

    from nblib.budget.model_vram import model_vram
    from nblib.config import named_config
    from nblib.encode.run import _model_vram_preflight, plan_encode
    from nblib.encode.token_records import TokenRecords

    ids = token_records(tmp_path / "records", 12)
    source = TokenRecords(tmp_path / "records", "ids")
    assert source.inputs == f"tokens:{max(len(x) for x in ids)}"
    run = plan_encode(source, tmp_path / "run", named_config("smoke").replace(batch_size=8), "cpu", model=bert)
    pf = importlib.import_module("nblib.budget.preflight")
    monkeypatch.setattr(pf, "_gpu_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(pf, "_free_vram", lambda device=None: 15 * 2**30)
    seen = []
    monkeypatch.setattr(pf, "model_vram_check", lambda *a, **k: seen.append(model_vram(*a, **k)) or seen[-1])
    _model_vram_preflight(type(run)(**{**run.__dict__, "torch_device": torch.device("cuda:0")}))
    assert seen and seen[0].lines == model_vram(bert, 8, precision="fp16", inputs=source.inputs).lines
