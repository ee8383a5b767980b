#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and print its python path.
#
# - If the Python we start from already has torch (a GPU box with its own build), the venv sees
#   it through --system-site-packages and every install is constrained to that exact version,
#   so nothing replaces it.
# - Otherwise, with an NVIDIA GPU visible, torch==$TORCH_VERSION comes from PyPI (CUDA build);
#   without one, the CPU build (+cpu) is installed and CUDA packages are never pulled.
# - TORCHTITAN_TORCH_FROM_PYPI=1 (the smoke venvs of `run_tests.sh --torch 2.11`): torch==$TORCH_VERSION
#   (2.11 means the newest 2.11.x) comes from PyPI, a CUDA build that also runs on CPU, with the
#   machine's pip configuration bypassed (it may cap torch), and torchao is pinned to the release
#   built for that torch ($TORCHAO_VERSION overrides the table below).
# - Re-running is cheap: a stamp keyed on pyproject.toml and this script skips the work.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TORCHTITAN_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
from_pypi="${TORCHTITAN_TORCH_FROM_PYPI:-0}"
stamp="$venv/.torchtitan-setup"
key="$(cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
key="$key-$torch_version-$from_pypi"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" && -x "$venv/bin/python" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

log() { echo "[setup_env] $*" >&2; }
# pip warns about every missing package folder of the machine's extra local indexes: noise.
quiet_pip() { "$venv/bin/pip" "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
command -v "$python" >/dev/null || { log "error: '$python' not found; set PYTHON=/path/to/python3.11"; exit 1; }

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# The installed distribution's version (2.15.0 for PyPI's CUDA wheel, whose torch.__version__
# says 2.15.0+cu132): what a pip constraint must name to match it. Read from the metadata, not
# by importing torch: before numpy is installed, torch's import warns "Failed to initialize NumPy".
torch_dist='import importlib.metadata as m; print(m.version("torch"))'

# torchao releases are built for one torch minor version each.
torchao_for() {
    case "$1" in
        2.11* | 2.12*) echo 0.17.0 ;;
        *) echo 0.18.0 ;;
    esac
}

if [[ "$from_pypi" == 1 ]]; then
    # The machine's pip configuration may cap torch (a constraint file): bypass it for this venv.
    export PIP_CONFIG_FILE=/dev/null
    unset PIP_CONSTRAINT PIP_REQUIRE_VIRTUALENV
    spec="torch==$torch_version"
    [[ "$torch_version" == *.*.* ]] || spec="torch==$torch_version.*"
    [[ -d "$venv" ]] || "$python" -m venv "$venv"
    if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
        log "installing $spec from PyPI into $venv (a CUDA build; it also runs on CPU)"
        quiet_pip install -q "$spec" >&2
    fi
    existing="$("$venv/bin/python" -c "$torch_dist")"
    echo "torchao==${TORCHAO_VERSION:-$(torchao_for "$existing")}" >>"$constraints"
elif existing="$("$python" -c "$torch_dist" 2>/dev/null)"; then
    log "using the torch already installed for $python: $existing (it will not be replaced)"
    [[ -d "$venv" ]] || "$python" -m venv --system-site-packages "$venv"
else
    [[ -d "$venv" ]] || "$python" -m venv "$venv"
    if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            log "NVIDIA GPU found: installing torch==$torch_version (CUDA build)"
            quiet_pip install -q "torch==$torch_version" >&2
        else
            log "no NVIDIA GPU: installing the CPU build torch==$torch_version+cpu"
            quiet_pip install -q "torch==$torch_version+cpu" >&2 2>/dev/null ||
                quiet_pip install -q "torch==$torch_version+cpu" \
                    --extra-index-url https://download.pytorch.org/whl/cpu >&2
        fi
    fi
    existing="$("$venv/bin/python" -c "$torch_dist")"
fi
echo "torch==$existing" >>"$constraints"

# The dev extra includes torchft (docs/fault_tolerance.md): the constraint keeps it on this torch
# (its wheel depends on any torch, so unconstrained pip could pull a CUDA build in its place).
log "installing torchtitan and its dependencies (constrained to torch==$existing)"
quiet_pip install -q -c "$constraints" -e "$root[dev]" >&2
echo "$key" >"$stamp"
echo "$venv/bin/python"
