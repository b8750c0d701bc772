# Two commands do all the set-up on a fresh machine: `make run` (the whole suite, headless, on the
# default profile) and `make test` (unit tests + nbval over notebooks/). `make lab` opens JupyterLab.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

.PHONY: install run test test-browser test-cuda-build lint lab clean drive-zip

lint: $(STAMP)
	$(BIN)/ruff check .

install: $(STAMP)

# The requirements go in with uv (pinned in scripts/uv_install.py, installed by pip, fed pip's own indexes
# and find-links so it picks the same builds: torch's CPU wheel, no nvidia-* package): about 6x faster
# than pip here (benchmarks/install_time.sh). pip installs them instead when uv cannot be had or fails,
# or with `make install INSTALLER=pip`.
INSTALLER ?= uv
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(filter uv,$(INSTALLER)),$(BIN)/python scripts/uv_install.py $(BIN)/python requirements.txt || )$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -qq --no-deps -e .   # -qq: not setuptools' 11-line "Editable installation" warning
	touch $(STAMP)

# nblib's own .pyc files, written before the processes start: with PYTHONDONTWRITEBYTECODE=1 (this machine, CI)
# each process compiled the sources again (0.1-0.3 CPU-s each, in hundreds of test processes); 0.3 s here.
BYTECODE := $(BIN)/python -m compileall -q nblib

# the notebooks' kernels run one torch thread, as `make test` runs them: `nblib suite` sets OMP_NUM_THREADS=1
# MKL_NUM_THREADS=1 (nblib.suite.KERNEL_THREADS) where they are unset, and its first line prints them
run: $(STAMP)
	$(BYTECODE)
	$(BIN)/python -m nblib suite

# Tests and notebooks in JOBS pytest-xdist workers (`make test JOBS=0` runs them in this process).
# One torch thread per worker (OMP/MKL_NUM_THREADS=1, inherited by the notebooks' kernels): JOBS workers with
# a thread per core each oversubscribe the cores, and torch's spinning threads then ran a smoke encode 10-18x
# slower (notebook 03's offload comparison: 129 s, 10 s with one thread). The CLI subprocesses run so already.
# --dist loadfile keeps each file in one worker: a notebook's cells share one kernel, in order, and a
# module's fixtures are built once; --no-loadscope-reorder hands the files out in conftest.py's order (longest
# first), not xdist's (most tests first). pytest's exit status is make's (and .ci/run's).
# More workers than cores: with two, user + sys time was 164-166% of the cores over a fresh-clone run (a
# worker waits on its subprocesses, fsyncs and servers); with three, 175%, and pytest took 17 min 34 s against
# 19 min 35 s for the same commit, idle. Four (2026-11-27, fresh clones of nearly one commit): 88% of the cores
# and 11 min 51 s, against 79% and 12 min 41 s with three. Every test must pass beside a busy CPU anyway.
JOBS ?= 4
test: $(STAMP)
	$(BIN)/ruff check .
	$(BYTECODE)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 NBLIB_PROFILE=smoke $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=15 tests notebooks $(NBVAL)   # nbval references are recorded on smoke, GPU or not

# only the browser test: JupyterLab in headless Chromium (`make test` runs it too; both skip it, with the
# reason, where Debian's chromium or playwright is missing)
test-browser: $(STAMP)
	$(BIN)/python -m pytest -q -m browser tests/test_browser.py -p no:cacheprovider

# Colab's torch is a CUDA build: PyPI's default torch==2.13.0 wheel (CUDA 13, with its nvidia-* packages; it imports
# and traces without a GPU) goes into its own venv outside the repo, beside the runtime pins of requirements.txt that
# budget imports, taken from PyPI by uv (which ignores this machine's find-links, where the CPU wheel lies; pip with no
# configuration where uv is missing); then tests/test_cuda_build_torch.py runs `budget` there and in .venv.
# Cold here (2026-12-07): ~2.4 GB downloaded in 43-77 s (uv), 4.9 GB on disk; the test 4-7 min beside other work.
CUDA_TORCH_VENV ?= $(HOME)/.cache/nblib-cuda-torch
CUDA_TORCH_PINS := torch|numpy|psutil|pillow|tqdm|matplotlib|ipywidgets|transformers|safetensors|xxhash|zstandard
test-cuda-build: $(STAMP)
	test -x $(CUDA_TORCH_VENV)/bin/python || $(PY) -m venv $(CUDA_TORCH_VENV)
	grep -E '^($(CUDA_TORCH_PINS))==' requirements.txt > $(CUDA_TORCH_VENV)/requirements.txt
	$(BIN)/uv pip install -q --system-certs --python $(CUDA_TORCH_VENV)/bin/python -r $(CUDA_TORCH_VENV)/requirements.txt \
	  || env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
	     $(CUDA_TORCH_VENV)/bin/python -m pip install -q -r $(CUDA_TORCH_VENV)/requirements.txt
	NBLIB_CUDA_TORCH_VENV=$(CUDA_TORCH_VENV) OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -s \
	  -p no:cacheprovider tests/test_cuda_build_torch.py

lab: $(STAMP)
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks

clean:
	rm -rf outputs/notebooks outputs/figures outputs/drive outputs/staging

# A clean copy for Google Drive (docs/colab.md): the tracked files at HEAD under one top folder, nblib-suite/,
# which the notebooks' setup cell finds as MyDrive/nblib-suite.zip. No .venv, no outputs/ (not even its
# .gitkeep: a run makes the folder), nothing uncommitted.
drive-zip:
	mkdir -p outputs
	git archive --format=zip --prefix=nblib-suite/ -o outputs/nblib-suite.zip HEAD -- . ':(exclude)outputs'
	@echo "wrote outputs/nblib-suite.zip: upload it to MyDrive/ (docs/colab.md)"
