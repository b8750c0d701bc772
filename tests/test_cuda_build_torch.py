"""`budget` under a CUDA build of torch 2.13 (PyPI's default wheel, as Colab's), with no GPU, beside .venv's CPU build.

`make test-cuda-build` makes the venv (outside the repo: NBLIB_CUDA_TORCH_VENV, default ~/.cache/nblib-cuda-torch)
with PyPI's torch==2.13.0 and its nvidia-* packages beside nblib's runtime pins, then runs this file. Each case is
`python -m nblib budget ...` started cold from this checkout in both venvs, each with its own empty per-user folder
(XDG_CACHE_HOME), and the two printed answers must be equal.
- The seed table (nblib.budget.trace_store.SHIPPED, keyed by torch's major.minor: `2.13.0+cu130` is 2.13) answers every
  spec it holds with no child trace. Shown two ways: the run's $CXX is /bin/false, so a trace (which needs the
  fake-CUDA shim, compiled on first use) would end the run with an error, and the per-user folder stays empty (the
  trace store makes its `traces` folder only on a miss).
- A spec outside the table (encode with the math attention backend) and a training step (`budget --model
  trm:smoke --train`: backward on the fake device, which threw `hasPrimaryContext expects a valid device index`
  under the CUDA build before nblib.budget.shim registered its own hooks over the build's) are traced under the
  CUDA build, through the shim compiled against that build's headers, and give the CPU build's answer.
Without NBLIB_CUDA_TORCH_VENV (`make test`) the file skips, naming the target; a venv it names that is not there,
or holds no CUDA build, fails.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMED = os.environ.get("NBLIB_CUDA_TORCH_VENV")      # set by `make test-cuda-build`
VENV = Path(NAMED or Path.home() / ".cache" / "nblib-cuda-torch")
CUDA_PYTHON = VENV / "bin" / "python"
# the codec line orders the codecs by a decode timing: a measurement, not part of the budget
TIMED = re.compile(r"; fastest decoding first: [^;]*")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cuda_python() -> Path:
    """The CUDA build's interpreter: skips where the venv was never made, fails where a named one is wrong."""
    if not NAMED:
        pytest.skip("run by `make test-cuda-build`, which makes the venv of PyPI's CUDA build of torch (~2.4 GB "
                    "download, 4.9 GB) and names it in NBLIB_CUDA_TORCH_VENV; 3-5 min, kept out of `make test`")
    if not CUDA_PYTHON.exists():
        pytest.fail(f"no venv with PyPI's CUDA build of torch at {VENV}: `make test-cuda-build` makes it")
    probe = ("import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
             "'gpu': torch.cuda.is_available()}))")
    done = subprocess.run([str(CUDA_PYTHON), "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    build = json.loads(done.stdout.strip().splitlines()[-1])
    assert build["cuda"] and build["version"].startswith("2.13."), f"{VENV} holds no CUDA build of 2.13: {build}"
    print(f"CUDA build: torch {build['version']} (CUDA {build['cuda']}), GPU available: {build['gpu']}")
    return CUDA_PYTHON


def budget(python: Path, args: list[str], cache_home: Path, cxx: str | None = None) -> tuple[str, float]:
    """`python -m nblib budget ARGS` in a fresh process from this checkout: (its stdout less the timed clause,
    seconds); a failure is the test's, with the run's last lines.
    """
    cache_home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBLIB_", "PYTORCH_"))}   # a user's defaults
    env.update(XDG_CACHE_HOME=str(cache_home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if cxx:
        env["CXX"] = cxx
    start = time.perf_counter()
    done = subprocess.run([str(python), "-m", "nblib", "budget", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"{python} budget {' '.join(args)}: {(done.stdout + done.stderr)[-3000:]}"
    return TIMED.sub("", done.stdout), seconds


def table_cases() -> list[list[str]]:
    """One `budget` command line per spec of the shipped table (trace_table.TABLE_CONFIGS, one per spec)."""
    from trace_table import TABLE_CONFIGS

    from nblib.budget.devices import device_preset
    from nblib.budget.encode_trace import encode_spec
    from nblib.budget.trace_store import SHIPPED, entry_key, entry_name
    from nblib.config import preset

    cases, seen = [], set()
    for config, device in TABLE_CONFIGS:
        name = next(n for n in ("seed_t4", "t4", "smoke") if preset(n).model == config.model)
        spec = encode_spec(config, device_preset(device), "fp16", _attention(device), "async")
        key = json.dumps(spec, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        assert (SHIPPED / entry_name(entry_key(spec, "2.13", {}))).exists(), f"not in the shipped table: {spec}"
        cases.append(["--preset", name, "--device", device, "--outputs", ",".join(config.run.outputs),
                      "--dtype", config.run.out_dtype])
    return cases


def _attention(device: str) -> str:
    from nblib.budget._checks import attention_on
    from nblib.budget.devices import device_preset

    return attention_on(device_preset(device), None)


def test_the_cuda_build_answers_every_shipped_spec_from_the_table_as_the_cpu_build_does(cuda_python, tmp_path):
    cases = table_cases()
    from nblib.budget.trace_store import SHIPPED

    assert len(cases) == len(list(SHIPPED.glob("*.json"))), "a shipped entry is not one of TABLE_CONFIGS"

    def run(item):
        i, args = item
        return [budget(python, args, tmp_path / f"{tag}{i}", cxx="/bin/false")
                for tag, python in (("cpu", Path(sys.executable)), ("cuda", cuda_python))]

    with ThreadPoolExecutor(2) as pool:                  # two CLI processes at a time (two cores here)
        results = list(pool.map(run, enumerate(cases)))
    for args, ((cpu, cpu_s), (cuda, cuda_s)) in zip(cases, results):
        print(f"budget {' '.join(args)}: CPU build {cpu_s:.1f} s, CUDA build {cuda_s:.1f} s")
        assert "VRAM" in cuda and "max batch size on" in cuda
        assert cuda == cpu, f"budget {' '.join(args)} differs between the builds"
    kept = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()]
    assert not kept, f"a run traced or built the shim instead of reading the shipped table: {kept}"


def test_the_cuda_build_traces_outside_the_table_and_trains_through_the_shim_as_the_cpu_build(cuda_python,
                                                                                             tmp_path):
    from nblib.budget.shim import backward_capability

    ok, why = backward_capability()
    if not ok:
        pytest.skip(why)
    cases = [["--preset", "smoke", "--device", "t4", "--sdpa", "math"],               # a spec not in the table
             ["--model", "trm:smoke", "--device", "t4", "--batch-size", "32", "--train"]]
    for args in cases:
        cpu, cpu_s = budget(Path(sys.executable), args, tmp_path / "cpu")
        cuda, cuda_s = budget(cuda_python, args, tmp_path / "cuda")
        print(f"budget {' '.join(args)}: CPU build {cpu_s:.1f} s, CUDA build {cuda_s:.1f} s")
        assert cuda == cpu, f"budget {' '.join(args)} differs between the builds"
    assert "training step" in cuda and "traced on the simulated GPU" in cuda
    heads = [json.loads(p.read_text(encoding="utf-8"))["head"]
             for p in (tmp_path / "cuda" / "nblib" / "traces").glob("*.json")]
    math = [h for h in heads if h["spec"].get("sdpa") == "math"]
    assert len(math) == 1, "the spec outside the table was not traced and kept under the CUDA build"
    assert math[0]["torch"] == "2.13"
    shims = list((tmp_path / "cuda" / "nblib" / "shim").glob("nblib-fake-cuda-*.so"))
    assert len(shims) == 1, "the CUDA build traced without the shim"
    linked = subprocess.run(["ldd", str(shims[0])], capture_output=True, text=True).stdout
    assert str(VENV.resolve()) in linked or str(VENV) in linked, f"the shim is not built against {VENV}: {linked}"
