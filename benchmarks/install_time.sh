#!/usr/bin/env bash
# pip against uv: `make install`'s requirements step into a fresh venv, side by side, cold caches.
#
#   bash benchmarks/install_time.sh            # ROUNDS=2: pip, uv, uv, pip (interleaved, ABBA)
#
# Each run gets a new venv and new, empty PIP_CACHE_DIR and UV_CACHE_DIR (nothing downloaded before
# is reused; the machine's shared caches are left alone). Both runs start with the Makefile's
# `pip install --upgrade pip`; the pip run then does `pip install -r requirements.txt`, the uv run
# `scripts/uv_install.py` (pip installs uv==UV_VERSION, then uv installs the requirements with pip's
# own indexes). Prints seconds per step and the load average around each, then checks that both
# venvs hold the same distributions (torch's CPU build among them, and no nvidia-*/cuda-* package).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
PY=${PY:-python3}
work=$(mktemp -d /tmp/install-time.XXXXXX)
load() { cut -d' ' -f1-3 /proc/loadavg; }
step() {   # step NAME COMMAND...: time one step, with the load average before and after
    local start=$SECONDS before; before=$(load)
    "${@:2}" >"$work/$1.log" 2>&1; local rc=$?
    printf '%-28s %5d s  rc=%d  load %s -> %s\n' "$1" $((SECONDS - start)) "$rc" "$before" "$(load)"
}
one() {    # one TOOL N
    local venv="$work/$1-$2"
    export PIP_CACHE_DIR="$work/cache-pip-$1-$2" UV_CACHE_DIR="$work/cache-uv-$1-$2"
    local start=$SECONDS
    step "$1-$2 venv" "$PY" -m venv "$venv"
    step "$1-$2 pip upgrade" "$venv/bin/python" -m pip install -q --upgrade pip
    if [[ $1 == pip ]]; then
        step "$1-$2 requirements" "$venv/bin/python" -m pip install -q -r requirements.txt
    else
        step "$1-$2 requirements" "$venv/bin/python" scripts/uv_install.py "$venv/bin/python" requirements.txt
    fi
    printf '%-28s %5d s\n' "$1-$2 TOTAL" $((SECONDS - start))
    "$venv/bin/python" -m pip freeze --exclude uv --exclude pip | sort >"$work/$1-$2.freeze"
    rm -rf "$PIP_CACHE_DIR" "$UV_CACHE_DIR"
}
echo "work: $work  cores: $(nproc)  load: $(load)"
order=(pip uv uv pip pip uv uv pip)
for ((i = 0; i < 2 * ROUNDS; i++)); do one "${order[i]}" "$i"; done
echo "torch: $(grep -h '^torch==' "$work"/*.freeze | sort -u | tr '\n' ' ')"
echo "nvidia/cuda packages: $(cat "$work"/*.freeze | grep -c -E '^(nvidia|cuda)-')"
first=$(ls "$work"/*.freeze | head -1)
for f in "$work"/*.freeze; do
    diff -q "$first" "$f" >/dev/null && echo "same distributions: $(basename "$f")" \
        || { echo "DIFFERENT: $(basename "$f")"; diff "$first" "$f" | head -20; }
done
