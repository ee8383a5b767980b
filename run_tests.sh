#!/usr/bin/env bash
# Run the whole test suite on this machine (CPU is enough): lint, types, then pytest.
#
#   ./run_tests.sh                 the fast tier, pytest -m "not slow" (what CI runs)
#   ./run_tests.sh --all           everything, the slow tier included
#   ./run_tests.sh -m slow         extra arguments go to pytest (a -m of yours replaces the tier's)
#   ./run_tests.sh --torch 2.11    the smoke tier against another torch of the supported window
#                                  (2.11 ... 2.15) in its own venv, .venv-torch2.11 (built on the
#                                  first use from PyPI: a CUDA build, a few GB, runs on CPU):
#                                  unit checks and what a user runs (run_train.sh with a SIGTERM
#                                  and a bitwise resume, the SLURM script's line as 2 localhost
#                                  nodes, scripts/gpu_check.sh --cpu), all launched as a user does
#
# The first run creates .venv (scripts/setup_env.sh); set TORCHTITAN_PYTHON to use another python.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"

# Tests never touch the network.
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true

if [[ "${1:-}" == "--torch" ]]; then
    version="${2:?usage: ./run_tests.sh --torch 2.11 [pytest arguments]}"
    shift 2
    start=$(date +%s)
    python="$(TORCHTITAN_VENV="$root/.venv-torch$version" TORCH_VERSION="$version" \
        TORCHTITAN_TORCH_FROM_PYPI=1 "$root/scripts/setup_env.sh")"
    ready=$(date +%s)
    echo "== smoke tier: $("$python" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)" \
        "(venv ready in $((ready - start)) s)"
    echo "== imports"
    "$python" -W ignore -c 'import torchtitan.train, torchtitan.training.trainer, torchtitan.planner.__main__'
    echo "== pytest -m smoke"
    status=0
    "$python" -m pytest -p no:cacheprovider -m smoke "$@" || status=$?
    echo "== smoke tier on torch $version: exit $status, $(($(date +%s) - start)) s in all"
    exit "$status"
fi

python="${TORCHTITAN_PYTHON:-$("$root/scripts/setup_env.sh")}"
bin="$(dirname "$python")"

echo "== ruff"
"$bin/ruff" check .
"$bin/ruff" format --check .
echo "== mypy"
"$bin/mypy"
tier=(-m "not slow")
if [[ "${1:-}" == "--all" ]]; then
    tier=()
    shift
fi
echo "== pytest ${tier[*]}"
"$python" -m pytest "${tier[@]}" "$@"
