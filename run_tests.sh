#!/usr/bin/env bash
# Run the whole test suite on this machine (CPU is enough): lint, types, then pytest.
#
#   ./run_tests.sh                 everything (what CI runs)
#   ./run_tests.sh -m "not slow"   extra arguments go to pytest
#
# The first run creates .venv (scripts/setup_env.sh); set TORCHTITAN_PYTHON to use another python.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
python="${TORCHTITAN_PYTHON:-$("$root/scripts/setup_env.sh")}"
bin="$(dirname "$python")"

# Tests never touch the network.
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true

echo "== ruff"
"$bin/ruff" check .
"$bin/ruff" format --check .
echo "== mypy"
"$bin/mypy"
echo "== pytest"
"$python" -m pytest "$@"
