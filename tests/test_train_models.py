"""Training any model, and training from record shards: `python -m nblib train --model SPEC` (a head on the
model's output, or its own logits) and `train --records DIR` SIGKILLed mid-run and rerun end with the
unkilled run's bytes (final weights, optimizer, RNG, data order, history); the record shards are read one
shard at a time; a resume with another model is refused naming what changed; hostile flags get one
`error:` line and exit 2. Real files, real processes, real SIGKILLs; tiny models, so each test is quick.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_nblib
from test_train import labelled_cache
from train_runs import run_and_kill, train_env

from conftest import importable_models
from nblib.errors import CacheError, ConfigError, ResumeMismatch
from nblib.train import TrainConfig, train
from nblib.train.records import RecordFields

STEPS = 24
ARGS = ["--steps", str(STEPS), "--batch-size", "16", "--save-every", "2", "--backup-every", "4", "--eval-every", "8",
        "--no-progress"]
CONFIG = TrainConfig(steps=STEPS, batch_size=16, save_every=2, backup_every=4, eval_every=8)   # what ARGS ask for
RESNET = {"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
          "layer_type": "basic", "image_size": 32}           # image_size: its preprocessing resizes to 32 px
TRACES = {"hidden": 32, "experts": 8, "layers": 4, "tokens": (4, 16)}
ROUTING = RecordFields("hidden_states", "target_routing", "ce")
FACTORY_SOURCE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """A conv net over 16 px inputs with its own logits, one per class of the test cache (12 kinds)."""

    preprocessing = {"size": [16, 16]}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.head = nn.Linear(6, 12)

    def forward(self, x):
        pooled = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return {"pooled": pooled, "logits": self.head(pooled)}


class Router(nn.Module):
    """The sharding guide's job: each token's expert routing from its hidden state (dropout draws the RNG)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 8))

    def forward(self, x):
        return {"logits": self.net(x)}


def build():
    return Tiny()


def router():
    return Router()
'''


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One torch thread, as the CLI subprocesses run (OMP_NUM_THREADS=1): the same bytes in both."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return labelled_cache(tmp_path_factory.mktemp("models"), 160)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A folder with a tiny ResNet config and an importable factory module (on sys.path and the CLI's PYTHONPATH)."""
    with importable_models(tmp_path_factory.mktemp("specs"), RESNET, FACTORY_SOURCE) as folder:
        yield folder


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory) -> Path:
    """400 guide-like trace records in ~20 small shards grouped by layer_id."""
    from record_traces import trace_records

    from nblib.cache import write_records

    out = tmp_path_factory.mktemp("records") / "shards"
    write_records(trace_records(400, **TRACES), out, shard_mb=0.02, group_by="layer_id")
    return out


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nblib", "train", *args, *ARGS]


def env_with(models: Path) -> dict[str, str]:
    env = train_env()
    env["PYTHONPATH"] = f"{models}:{env['PYTHONPATH']}"
    return env


def sigkill_mid_run(cmd: list[str], out: Path, env: dict) -> None:
    """Run `cmd` (a real `python -m nblib train`) and SIGKILL it once a state is saved (again if it finished
    first, as it can on a busy machine). The resume then runs in this process, as the reference did: one
    process start (torch, transformers) fewer per test.
    """
    for _attempt in range(3):
        run_and_kill(cmd, out, after_step=2, extra_s=0, env=env, finished_ok=True)
        if not (out / "final.pt").exists():
            break
        shutil.rmtree(out)
    assert not (out / "final.pt").exists(), "the run finished before it could be killed, 3 times"


def assert_same(a, b, where: str = "") -> None:
    """Equal, tensors bit for bit, floats with nan equal to nan, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


def assert_same_run(run: Path, reference: Path) -> None:
    """final.pt and the last full state (weights, AdamW moments, schedule, RNG, data order, history) are equal."""
    load = lambda path: torch.load(path, weights_only=True)  # noqa: E731
    assert_same(load(run / "final.pt"), load(reference / "final.pt"), "final.pt")
    state = f"checkpoints/state-{STEPS:06d}.pt"
    assert_same(load(run / state), load(reference / state), state)


@pytest.mark.slow
@pytest.mark.parametrize("spec, head", [("hf:ResNetModel:{models}/resnet.json", "linear"),
                                        ("tinyfactory:build", "own logits")])
def test_any_model_sigkilled_and_resumed_ends_with_the_unkilled_runs_bytes(spec, head, cache_dir, models, tmp_path):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    spec = spec.format(models=models)
    whole = train(cache_dir, tmp_path / "whole", CONFIG, model=spec)
    assert whole.final is not None and len(whole.classes) == 12
    killed = tmp_path / "killed"
    sigkill_mid_run(cli("--cache", str(cache_dir), "--out", str(killed), "--model", spec), killed, env_with(models))
    resumed = train(cache_dir, killed, CONFIG, model=spec)
    assert resumed.resumed_from == "local" and 2 <= resumed.start_step <= STEPS       # killed before final.pt
    assert_same_run(killed, tmp_path / "whole")
    final = torch.load(killed / "final.pt", weights_only=True)
    assert final["model"]["head"] == head and final["spec"] == spec
    assert final["output"] == ("pooler_output" if head == "linear" else "logits")
    from nblib.models import load_model

    trained = load_model(spec, killed / "final.pt")             # what encode --model SPEC --weights final.pt loads
    assert_same(trained.module.state_dict(), final["state_dict"])


def test_a_resume_with_another_model_or_output_is_refused_naming_what_changed(cache_dir, models, tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    spec = f"hf:ResNetModel:{models}/resnet.json"
    train(cache_dir, run, CONFIG, model=spec, stop_after=2)
    with pytest.raises(ResumeMismatch, match=r"class: transformers\.models\.resnet.*ResNetModel -> tinyfactory\.Tiny"):
        train(cache_dir, run, CONFIG, model="tinyfactory:build")
    with pytest.raises(ResumeMismatch, match=r"output: 'pooler_output' -> 'last_hidden_state'"):
        train(cache_dir, run, CONFIG, model=spec, output="last_hidden_state")
    with pytest.raises(ResumeMismatch, match=r"ResNetModel -> the TRM \(the default model\)"):
        train(cache_dir, run, CONFIG)
    wider = models / "wider.json"
    wider.write_text(json.dumps({**RESNET, "hidden_sizes": [8, 24]}))
    with pytest.raises(ResumeMismatch, match=r"config\.hidden_sizes: \[8, 16\] -> \[8, 24\]"):
        train(cache_dir, run, CONFIG, model=f"hf:ResNetModel:{wider}")
    done = run_nblib(*cli("--cache", str(cache_dir), "--out", str(run), "--model", "tinyfactory:build")[3:])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "trained another model" in lines[0] and "tinyfactory.Tiny" in lines[0]
    assert train(cache_dir, run, CONFIG, model=spec, stop_after=4).start_step == 2       # the right model resumes


@pytest.mark.slow
def test_training_from_record_shards_sigkilled_and_resumed_is_exact_and_reads_one_shard_at_a_time(
        records_dir, models, tmp_path, monkeypatch):
    from nblib.cache import RecordShards
    from nblib.train.loop import SAMPLE_LOG_ENV

    monkeypatch.setenv(SAMPLE_LOG_ENV, "1")
    whole = train(records_dir, tmp_path / "whole", CONFIG, model="tinyfactory:router", fields=ROUTING)
    assert whole.last["heldout_loss"] < whole.first["heldout_loss"]
    shards = RecordShards(records_dir)
    order = [int(i) for line in next((tmp_path / "whole" / "samples").glob("*.txt")).read_text().splitlines()
             for i in line.split(":")[1].split()]
    per_epoch = 320 // 16 * 16                                  # 400 records, 20% held out, whole batches
    assert len(order) == STEPS * 16 > per_epoch
    for start in range(0, len(order), per_epoch):
        read = [shards.locate(i)[0] for i in order[start:start + per_epoch]]
        runs = [s for k, s in enumerate(read) if k == 0 or read[k - 1] != s]
        assert len(runs) == len(set(runs)) > 3, runs           # each shard read in one stretch, then left
    killed = tmp_path / "killed"
    cmd = cli("--records", str(records_dir), "--input-key", "hidden_states", "--target-key", "target_routing",
              "--loss", "ce", "--model", "tinyfactory:router", "--out", str(killed))
    sigkill_mid_run(cmd, killed, env_with(models))
    resumed = train(records_dir, killed, CONFIG, model="tinyfactory:router", fields=ROUTING)
    assert resumed.resumed_from == "local" and 2 <= resumed.start_step <= STEPS       # killed before final.pt
    assert_same_run(killed, tmp_path / "whole")


def test_record_shards_train_the_builtin_linear_model_per_token_on_labels_or_by_regression(records_dir, tmp_path):
    import numpy as np

    from nblib.cache import write_records

    config = CONFIG.replace(steps=20, save_every=10, backup_every=10, eval_every=10)
    per_token = train(records_dir, tmp_path / "mse", config, fields=RecordFields("hidden_states", "target_routing"))
    assert per_token.classes == [] and math.isnan(per_token.last["heldout_accuracy"])       # auto: float -> mse
    final = torch.load(tmp_path / "mse" / "final.pt", weights_only=True)
    assert final["state_dict"]["weight"].shape == (8, 32) and final["loss"] == "mse"
    rng = np.random.default_rng(0)
    tokens = [rng.standard_normal((int(rng.integers(2, 9)), 4)).astype(np.float32) for _ in range(200)]
    write_records(({"x": x, "label": x[:, :3].argmax(1)} for x in tokens), tmp_path / "labelled", shard_mb=0.002)
    labelled = train(tmp_path / "labelled", tmp_path / "ce", config.replace(lr=0.05),
                     fields=RecordFields("x", "label", classes=3))                          # auto: integers -> ce
    assert labelled.classes == ["0", "1", "2"]
    assert labelled.last["heldout_accuracy"] > 0.6 > labelled.first["heldout_accuracy"]   # padded tokens not counted


def test_record_fields_the_records_lack_or_cannot_train_are_refused_naming_them(records_dir, tmp_path):
    for fields, model, expected in (
            (RecordFields("hidden", "target_routing"), None, "--input-key 'hidden' is not a field"),
            (RecordFields("hidden_states", "layer_id"), None, "pass --classes N"),
            (RecordFields("layer_id", "target_routing"), None, "is a scalar field"),
            (RecordFields("hidden_states", "layer_id", "mse"), None, "holds integers (class labels): use --loss ce"),
            (RecordFields("hidden_states", "target_routing"), "trm", "the TRM takes images")):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            train(records_dir, tmp_path / "run", CONFIG, fields=fields, model=model)
    with pytest.raises(CacheError, match="holds record shards, not images: read it with --records"):
        train(records_dir, tmp_path / "run", CONFIG)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "{cache}", "--model", "no_such_module_xyz:build"], "does not import"),
    (["--records", "{missing}", "--input-key", "a", "--target-key", "b"], "is not a folder of record shards"),
    (["--cache", "{cache}", "--target-key", "layer_id"], "go with --records"),
])
def test_hostile_model_and_record_flags_print_one_error_line_and_exit_2(argv, expected, cache_dir, tmp_path):
    argv = [a.format(cache=cache_dir, missing=tmp_path / "nope") for a in argv]
    done = run_nblib(*cli(*argv, "--out", str(tmp_path / "run"))[3:])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_model_that_cannot_take_the_input_is_refused_at_start_naming_it(records_dir, cache_dir, models, tmp_path):
    with pytest.raises(ConfigError, match=r"--model tinyfactory:build on --input-key hidden_states \[1, \d+, 32\]"):
        train(records_dir, tmp_path / "run", CONFIG, fields=ROUTING, model="tinyfactory:build")
    with pytest.raises(ConfigError, match=r"the model has no output 'features'; its outputs are \['logits'\]"):
        train(records_dir, tmp_path / "run", CONFIG, fields=ROUTING, model="tinyfactory:router", output="features")
    with pytest.raises(ConfigError, match=r"no output 'sketches'; its outputs are \['pooled', 'logits'\]"):
        train(cache_dir, tmp_path / "run", CONFIG, model="tinyfactory:build", output="sketches")
    with pytest.raises(ConfigError, match=r"--output sketches picks one output of a --model"):
        train(cache_dir, tmp_path / "run", CONFIG, output="sketches")
    assert not (tmp_path / "run").exists()
