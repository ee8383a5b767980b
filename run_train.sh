#!/usr/bin/env bash
# Launch training through torchrun.
#
#   NGPU=4 LOG_RANK=0,3 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --training.steps 50
#
# NGPU         ranks on this machine (default: the number of GPUs, or 2 without a GPU)
# LOG_RANK     ranks whose output is shown, torchrun's --local-ranks-filter (default 0)
# CONFIG_FILE  TOML config (default train_configs/debug_model.toml)
# extra args   config overrides, e.g. --parallelism.data_parallel_shard_degree 2 --metrics.log_freq 1
#
# The first run creates .venv (scripts/setup_env.sh); set TORCHTITAN_PYTHON to use another python.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${CONFIG_FILE:-train_configs/debug_model.toml}"
[[ "$config" = /* || -f "$config" ]] && config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
cd "$root"

python="${TORCHTITAN_PYTHON:-$("$root/scripts/setup_env.sh")}"

if [[ -z "${NGPU:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" && [[ "$n" -gt 0 ]]; then
        NGPU="$n"
    else
        NGPU=2
    fi
fi
LOG_RANK="${LOG_RANK:-0}"

# Without GPUs the ranks share the CPU cores: give each its share of threads.
if [[ -z "${OMP_NUM_THREADS:-}" ]] && ! "$python" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cores="$(nproc)"
    export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-0}"

exec "$python" -m torch.distributed.run \
    --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$config" "$@"
